//! Guards against a parameter handed to compute taking a trip through the host pool
//! when compute reads the device tier (`Trainer::set_compute_on_device`, what
//! `finetune` asks for on a GPU, where candle then copies device to device): the view
//! `fetch_view` hands out is the device tier's, in the stored dtype (bf16 for a
//! trainable parameter in `Bf16`, f32 for a frozen one), and holds the values `fetch`
//! decodes. On the simulated device the device tier is host memory, so the test runs
//! everywhere; on a GPU the same view is a device pointer.

use tidestore_train::{
    DType, DeviceChoice, DeviceView, HyperParams, ParamSpec, Precision, TensorState, TensorView,
    Trainer, TrainerConfig,
};

/// Where a view is, its bytes, and their dtype.
fn seen(v: TensorView<'_>, dtype: DType) -> (&'static str, Vec<u8>, DType) {
    match v {
        TensorView::Host(b) => ("host pool", b.to_vec(), dtype),
        TensorView::Device(DeviceView::Host(b)) => ("device tier", b.to_vec(), dtype),
        TensorView::Device(DeviceView::Cuda(_)) => ("GPU", Vec::new(), dtype),
    }
}

#[test]
fn compute_on_the_device_reads_the_device_tier_in_the_stored_dtype() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = TrainerConfig::new(
        HyperParams::adamw(1e-3, (0.9, 0.999), 1e-8, 0.0),
        dir.path(),
    );
    cfg.precision = Precision::Bf16;
    cfg.device = DeviceChoice::Sim;
    let specs = [
        ParamSpec::new("w", &[64, 33], true),
        ParamSpec::new("frozen", &[17], false),
    ];
    let mut t = Trainer::open(&specs, &cfg).unwrap();
    let w: Vec<f32> = (0..64 * 33).map(|i| (i as f32 - 1000.0) * 0.013).collect();
    let frozen: Vec<f32> = (0..17).map(|i| i as f32 * 0.25 - 2.0).collect();
    t.set_values(0, &w).unwrap();
    t.set_values(1, &frozen).unwrap();
    t.set_compute_on_device(true);

    let bf16 = |b: &[u8]| half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
    let f32 = |b: &[u8]| f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let want = t.fetch(0, TensorState::HoldAfterFwd).unwrap();
    for (i, what, want_dtype, want) in [
        (0, "trainable", DType::BF16, want),
        (1, "frozen", DType::F32, frozen),
    ] {
        let (place, bytes, dtype) = t.fetch_view(i, TensorState::HoldAfterFwd, seen).unwrap();
        assert_eq!(
            place, "device tier",
            "a {what} parameter came from the {place}"
        );
        assert_eq!(dtype, want_dtype, "{what}");
        let decoded: Vec<f32> = match dtype {
            DType::BF16 => bytes.chunks_exact(2).map(bf16).collect(),
            _ => bytes.chunks_exact(4).map(f32).collect(),
        };
        assert_eq!(decoded, want, "{what}");
    }
}
