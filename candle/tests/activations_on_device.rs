//! Guards against chunks taking the memory the blocks' activations need where the
//! blocks compute: on the simulated device that stands in for a GPU (where the store
//! cannot measure what candle allocates, as it does on one), the layer-streamed
//! trainer counts the saved block inputs, the gradients flowing back and what a block
//! allocates as the device's non-model memory, and the store's tide leaves them room.
//! Were they not counted, the reported peak would be 0 and the tide would stay at the
//! device budget while the activations are alive; the losses do not depend on it.

mod common;

use candle_core::Device;
use common::*;
use tidestore_candle::{train_step, Precision, TideParams};
use tidestore_train::MicroBatchOrder::{Horizontal, Vertical};
use tidestore_train::{BlockSchedule, DeviceChoice, SavedInputs};

/// Three steps of the small LLaMA, 2 micro-batches as `schedule` says, on a simulated
/// device of a 4-chunk budget plus `beside` bytes; the losses, what the last two steps
/// showed (the first traces the schedule) and the budget.
fn train(
    schedule: impl Into<BlockSchedule> + Copy,
    counts: bool,
    beside: u64,
) -> (Vec<f32>, Seen, u64) {
    let model = llama(false, false);
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = tide_config(dir.path(), Precision::F32);
    cfg.device = DeviceChoice::Sim;
    cfg.sim_activation_bytes = beside;
    let mut p = TideParams::open(&model.init(3), &cfg, &Device::Cpu).unwrap();
    let device_bytes = p.trainer().store().device().mem_info().unwrap().total_bytes;
    let budget = p.trainer().store().device_budget_bytes();
    assert_eq!(device_bytes, budget + beside);
    let data = batches();
    let mut w = Through::new(&mut p, true);
    w.counts = counts;
    w.device_bytes = device_bytes;
    let mut losses = Vec::new();
    for step in 0..3 {
        let mb: Vec<_> = (0..2)
            .map(|k| data.get(2 * step + k, &Device::Cpu).unwrap())
            .collect();
        if step == 1 {
            w.seen = Seen::default();
        }
        losses.push(train_step(&mut w, &model, &mb, schedule).unwrap().loss);
    }
    (losses, w.seen, budget)
}

/// The bytes of every block input the vertical order keeps for two micro-batches of
/// 4 × 16 tokens at the head: the tokens (u32) and four hidden states of 32 f32.
const SAVED_AT_HEAD: u64 = 2 * (4 * 16 * 4 + 4 * 4 * 16 * 32 * 4);

#[test]
fn the_activations_are_the_simulated_devices_non_model_memory() {
    // Room beside the budget for all but half the budget of the activations' peak
    // (measured on a device with room for all of it), so that the tide gives way.
    let (_, roomy, budget) = train(Vertical, true, 1 << 20);
    assert!(
        roomy.peak_reported > budget,
        "{roomy:?}: activations below the budget"
    );
    let beside = roomy.peak_reported - budget / 2;
    let (counted, seen, _) = train(Vertical, true, beside);
    let (uncounted, blind, _) = train(Vertical, false, beside);
    assert_eq!(counted, uncounted, "where chunks live changes no loss");
    assert!(
        seen.peak_reported > SAVED_AT_HEAD,
        "the activations' peak {} does not cover the saved inputs' {SAVED_AT_HEAD} bytes",
        seen.peak_reported
    );
    assert_eq!(blind.peak_reported, 0);
    assert_eq!(seen.over, 0, "chunks and activations exceeded the device");
    // The tide gives way to the activations beyond the room beside the budget.
    assert!(
        seen.lowest_tide < budget && seen.lowest_tide + seen.peak_reported <= budget + beside,
        "lowest tide {} (budget {budget}, {beside} beside it, peak activations {})",
        seen.lowest_tide,
        seen.peak_reported
    );
    assert_eq!(
        blind.lowest_tide, budget,
        "nothing reported, nothing given way"
    );
}

/// Horizontal order keeps one micro-batch's inputs at a time: its peak is below
/// vertical's by at least the other micro-batch's saved inputs.
#[test]
fn vertical_order_holds_every_micro_batchs_inputs() {
    let (lv, v, _) = train(Vertical, true, 1 << 20);
    let (lh, h, _) = train(Horizontal, true, 1 << 20);
    for (a, b) in lv.iter().zip(&lh) {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "{lv:?} {lh:?}");
    }
    assert!(
        v.peak_reported >= h.peak_reported + SAVED_AT_HEAD / 2,
        "vertical {} horizontal {}",
        v.peak_reported,
        h.peak_reported
    );
}

/// Saved inputs in host memory leave the device the inputs the next block reads (one
/// per micro-batch) and one brought back for a backward: of the eight hidden states and
/// two token blocks saved at the head, the peak sheds at least four hidden states. The
/// losses are those of inputs kept on the device, bit for bit.
#[test]
fn saved_inputs_in_host_memory_are_not_the_devices() {
    let on_host = BlockSchedule {
        order: Vertical,
        saved_inputs: SavedInputs::Host,
    };
    let (ld, d, _) = train(Vertical, true, 1 << 20);
    let (lh, h, _) = train(on_host, true, 1 << 20);
    assert_eq!(ld, lh);
    let hidden = 4 * 16 * 32 * 4;
    assert!(
        h.peak_reported + SAVED_AT_HEAD - 2 * (4 * 16 * 4 + 2 * hidden) <= d.peak_reported,
        "host {} device {}",
        h.peak_reported,
        d.peak_reported
    );
    assert_eq!(h.over, 0);
}

/// Activations beyond the traced ones (micro-batches twice as long after the first
/// step, which traced the schedule) still find room: the tide never rises above what
/// the device has beside the activations now, so chunks and activations never exceed
/// the device (chunks the trace let stay were once left there, over it); where no room
/// is left for the working set, the step fails with the store's typed error instead.
#[test]
fn activations_beyond_the_traced_ones_still_find_room() {
    let model = llama(false, false);
    let run = |beside: u64| -> tidestore_candle::Result<Seen> {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = tide_config(dir.path(), Precision::F32);
        cfg.device = DeviceChoice::Sim;
        cfg.sim_activation_bytes = beside;
        let mut p = TideParams::open(&model.init(3), &cfg, &Device::Cpu)?;
        let mut w = Through::new(&mut p, true);
        w.device_bytes =
            w.p.trainer()
                .store()
                .device()
                .mem_info()
                .unwrap()
                .total_bytes;
        for (step, ctx) in [(0, 8), (1, 16), (2, 16)] {
            let data = tidestore_candle::Batches::new(TEXT[..20_000].to_vec(), 4, ctx, 7)?;
            let mb = (0..2)
                .map(|k| data.get(2 * step + k, &Device::Cpu))
                .collect::<tidestore_candle::Result<Vec<_>>>()?;
            train_step(&mut w, &model, &mb, Vertical)?;
        }
        Ok(w.seen)
    };
    let roomy = run(1 << 20).unwrap();
    let budget = 4 * 64 * 1024;
    // Room beside the budget for the short micro-batches' activations, not the long ones'.
    let beside = roomy.peak_reported - budget / 2;
    let tight = run(beside).unwrap();
    assert_eq!(tight.over, 0, "{tight:?}");
    assert!(tight.lowest_tide < budget / 2 + 4096, "{tight:?}");
    let e = run(roomy.peak_reported - budget).unwrap_err();
    assert!(
        matches!(
            e,
            tidestore_candle::Error::Train(tidestore_train::TrainError::Store(
                tidestore_train::ChunkError::WorkingSetTooLarge { .. }
            ))
        ),
        "{e:?}"
    );
}
