//! Dense peak FLOP/s of the accelerators a report may name, for MFU (model FLOPs utilisation:
//! achieved FLOP/s over the device's peak). Dense figures only: the "with sparsity" figures
//! of the datasheets are twice these and no dense training step reaches them.
//!
//! Sources (vendor datasheets, boost clock): NVIDIA H100 datasheet (SXM5: BF16/FP16 989.4,
//! TF32 494.7, FP32 66.9 TFLOP/s; PCIe: 756, 378, 51.2); NVIDIA H200 datasheet (SXM: as H100
//! SXM; NVL: 835, 418, 60); NVIDIA A100 datasheet (SXM4 and PCIe alike: 312, 156, 19.5);
//! NVIDIA V100 datasheet (SXM2: FP16 tensor 125, FP32 15.7; PCIe: 112, 14; no BF16 or TF32);
//! NVIDIA L40S datasheet (362.05, 183, 91.6); AMD Instinct MI250X datasheet (FP16/BF16 383,
//! FP32 matrix 95.7, no TF32); AMD Instinct MI300X datasheet (1307.4, TF32 653.7, FP32 163.4).

/// One device's dense peaks, TFLOP/s; None where the device has no such unit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Peaks {
    pub name: &'static str,
    pub half: Option<f64>,
    pub bf16: Option<f64>,
    pub tf32: Option<f64>,
    pub fp32: f64,
}

const TABLE: &[(&[&str], Peaks)] = &[
    (&["h200", "nvl"], Peaks { name: "H200 NVL", half: Some(835.0), bf16: Some(835.0), tf32: Some(418.0), fp32: 60.0 }),
    (&["h200"], Peaks { name: "H200 SXM", half: Some(989.4), bf16: Some(989.4), tf32: Some(494.7), fp32: 66.9 }),
    (&["h100", "pcie"], Peaks { name: "H100 PCIe", half: Some(756.0), bf16: Some(756.0), tf32: Some(378.0), fp32: 51.2 }),
    (&["h100"], Peaks { name: "H100 SXM", half: Some(989.4), bf16: Some(989.4), tf32: Some(494.7), fp32: 66.9 }),
    (&["a100"], Peaks { name: "A100 (SXM4/PCIe)", half: Some(312.0), bf16: Some(312.0), tf32: Some(156.0), fp32: 19.5 }),
    (&["v100", "pcie"], Peaks { name: "V100 PCIe", half: Some(112.0), bf16: None, tf32: None, fp32: 14.0 }),
    (&["v100"], Peaks { name: "V100 SXM2", half: Some(125.0), bf16: None, tf32: None, fp32: 15.7 }),
    (&["l40s"], Peaks { name: "L40S", half: Some(362.05), bf16: Some(362.05), tf32: Some(183.0), fp32: 91.6 }),
    (&["mi250x"], Peaks { name: "MI250X", half: Some(383.0), bf16: Some(383.0), tf32: None, fp32: 95.7 }),
    (&["mi300x"], Peaks { name: "MI300X", half: Some(1307.4), bf16: Some(1307.4), tf32: Some(653.7), fp32: 163.4 }),
];

/// The table's entry for a device model as the driver names it ("NVIDIA H100 80GB HBM3",
/// "NVIDIA A100-SXM4-40GB", "Tesla V100-PCIE-16GB"); None for a model the table lacks.
pub fn lookup(model: &str) -> Option<Peaks> {
    let model = model.to_lowercase();
    TABLE.iter().find(|(words, _)| words.iter().all(|w| model.contains(w))).map(|(_, p)| *p)
}

/// The dense peak (TFLOP/s) for a run's `--precision` (fp32, tf32, bf16, fp16), with what it
/// is ("H100 SXM bf16 dense"); None where the device has no unit for it or the precision is
/// unknown.
pub fn for_precision(peaks: &Peaks, precision: &str) -> Option<(f64, String)> {
    let value = match precision {
        "fp16" => peaks.half,
        "bf16" => peaks.bf16,
        "tf32" => peaks.tf32,
        "fp32" => Some(peaks.fp32),
        _ => None,
    }?;
    Some((value, format!("{} {precision} dense, {value} TFLOP/s (datasheet)", peaks.name)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_names_find_their_datasheet_peaks() {
        let name = |m: &str| lookup(m).map(|p| p.name);
        assert_eq!(name("NVIDIA H100 80GB HBM3"), Some("H100 SXM"));
        assert_eq!(name("NVIDIA H100 PCIe"), Some("H100 PCIe"));
        assert_eq!(name("NVIDIA H200"), Some("H200 SXM"));
        assert_eq!(name("NVIDIA H200 NVL"), Some("H200 NVL"));
        assert_eq!(name("NVIDIA A100-SXM4-80GB"), Some("A100 (SXM4/PCIe)"));
        assert_eq!(name("Tesla V100-PCIE-16GB"), Some("V100 PCIe"));
        assert_eq!(name("Tesla V100-SXM2-32GB"), Some("V100 SXM2"));
        assert_eq!(name("NVIDIA L40S"), Some("L40S"));
        assert_eq!(name("AMD Instinct MI250X"), Some("MI250X"));
        assert_eq!(name("AMD Instinct MI300X"), Some("MI300X"));
        assert_eq!(name("NVIDIA GeForce RTX 3090"), None);
    }

    #[test]
    fn the_peak_follows_the_precision() {
        let h100 = lookup("NVIDIA H100 80GB HBM3").unwrap();
        assert_eq!(for_precision(&h100, "bf16").unwrap().0, 989.4);
        assert_eq!(for_precision(&h100, "tf32").unwrap().0, 494.7);
        assert_eq!(for_precision(&h100, "fp32").unwrap().0, 66.9);
        let v100 = lookup("Tesla V100-SXM2-32GB").unwrap();
        assert_eq!(for_precision(&v100, "fp16").unwrap().0, 125.0);
        assert!(for_precision(&v100, "bf16").is_none(), "V100 has no bf16 unit");
        assert!(for_precision(&h100, "int8").is_none());
    }
}
