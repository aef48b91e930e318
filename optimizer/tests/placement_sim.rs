//! Guards against device-resident groups being skipped or updated differently from host
//! groups: on the simulated device (every machine) a device group is updated by the
//! same kernel, reported as `Gpu` with `simulated`, and gives the bits of the host path;
//! without CUDA the GPU kernel reports why (`NotCompiledWithCuda` or `NoGpu`).

use tidestore_optimizer::half::bf16;
use tidestore_optimizer::{
    AdamW, CpuConfig, DType, Grads, HyperParams, OptimError, ParamGroup, ParamOut, StepState,
};
use tidestore_optimizer::{DeviceGroup, HybridAdamW, Placement, ResidentGroup};
use tidestore_tiers::{Device, DeviceConfig, DeviceViewMut};

fn fill(mem: &mut tidestore_tiers::DeviceMem, bytes: &[u8]) {
    match mem.view_mut() {
        DeviceViewMut::Host(b) => b[..bytes.len()].copy_from_slice(bytes),
        DeviceViewMut::Cuda(_) => unreachable!("simulated device"),
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn device_groups_update_where_they_are_and_match_the_host_path() {
    let n = 10_007;
    let cpu = AdamW::new(CpuConfig {
        threads: 1,
        ..CpuConfig::default()
    })
    .unwrap();
    let hybrid = HybridAdamW::new(cpu.clone(), 0);
    if !cfg!(feature = "cuda") {
        assert_eq!(hybrid.gpu_status(), Err(OptimError::NotCompiledWithCuda));
    } else if let Err(e) = hybrid.gpu_status() {
        println!("GPU kernel unavailable here: {e}");
    }
    let dev = Device::sim(&DeviceConfig::new(1 << 24)).unwrap();
    let p0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let g: Vec<bf16> = (0..n)
        .map(|i| bf16::from_f32((i as f32 * 0.11).cos() * 0.01))
        .collect();
    let g_bytes: Vec<u8> = g.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect();
    let mut dm = dev.alloc(1, n * 4).unwrap();
    let mut dmm = dev.alloc(2, n * 4).unwrap();
    let mut dv = dev.alloc(3, n * 4).unwrap();
    let mut dg = dev.alloc(4, n * 2).unwrap();
    let mut dout = dev.alloc(5, n * 2).unwrap();
    fill(&mut dm, &f32_bytes(&p0));
    fill(&mut dmm, &vec![0u8; n * 4]);
    fill(&mut dv, &vec![0u8; n * 4]);
    fill(&mut dg, &g_bytes);

    let (mut hp_, mut hm, mut hv) = (p0.clone(), vec![0.0f32; n], vec![0.0f32; n]);
    let mut hout = vec![bf16::ZERO; n];
    let hp = HyperParams::default();
    let state = StepState {
        step: 1,
        grad_scale: 0.5,
    };
    let mut groups = vec![
        ResidentGroup::Host {
            index: 0,
            group: ParamGroup {
                hp,
                master: &mut hp_,
                m: &mut hm,
                v: &mut hv,
                grads: Grads::Bf16(&g),
                out: Some(ParamOut::Bf16(&mut hout)),
            },
        },
        ResidentGroup::Device {
            index: 1,
            hp,
            group: DeviceGroup {
                len: n,
                master: &mut dm,
                m: &mut dmm,
                v: &mut dv,
                grads: &dg,
                grad_dtype: DType::BF16,
                out: Some((&mut dout, DType::BF16)),
            },
        },
    ];
    let report = hybrid.step_resident(state, &mut groups).unwrap();
    drop(groups);
    assert_eq!(report.count(Placement::Cpu), 1);
    assert_eq!(report.count(Placement::Gpu), 1);
    assert!(report.groups[1].simulated);
    let dev_p: Vec<f32> = match dm.view() {
        tidestore_tiers::DeviceView::Host(b) => b[..n * 4]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        _ => unreachable!(),
    };
    let dev_out: Vec<u16> = match dout.view() {
        tidestore_tiers::DeviceView::Host(b) => b[..n * 2]
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect(),
        _ => unreachable!(),
    };
    assert!(dev_p
        .iter()
        .zip(&hp_)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    assert!(dev_out.iter().zip(&hout).all(|(a, b)| *a == b.to_bits()));
    assert!(
        dev_p.iter().zip(&p0).any(|(a, b)| a != b),
        "the step changed something"
    );
}
