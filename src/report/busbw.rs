//! Bus bandwidth from the exchange benchmark (`bench.jsonl`): rows grouped into one plot per
//! (ranks, device, dtype, layout), a series per strategy, the most recent row per size. Pure:
//! the caller reads the file and draws.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::tables::slug;

/// The fields of a `hpc-train bench` row that the report uses (the file has more).
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct BenchRecord {
    /// Message size in bytes.
    pub size: usize,
    #[serde(rename = "type")]
    pub dtype: String,
    pub strategy: String,
    pub layout: String,
    /// GB/s.
    pub busbw: f64,
    pub wrong: u64,
    pub ranks: usize,
    pub device: String,
    pub date: String,
}

/// What bench rows must share to be drawn in one plot.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct BenchKey {
    pub ranks: usize,
    pub device: String,
    pub dtype: String,
    pub layout: String,
}

impl BenchKey {
    pub fn title(&self) -> String {
        format!("Bus bandwidth: {} ranks, {}, {}, {} layout", self.ranks, self.device, self.dtype, self.layout)
    }

    pub fn slug(&self) -> String {
        slug(&["busbw", &format!("{}ranks", self.ranks), &self.device, &self.dtype, &self.layout])
    }
}

#[derive(Debug, PartialEq)]
pub struct BenchGroup {
    pub key: BenchKey,
    /// Strategy -> (bytes, GB/s) by size ascending.
    pub series: BTreeMap<String, Vec<(usize, f64)>>,
}

/// Groups rows for plotting. Rows with wrong elements are left out (their timing measured a
/// broken exchange); of the others the most recent per (size, strategy) is kept, comparing the
/// `date` text (the fixed-width UTC form the benchmark writes) and, on a tie, the later line.
/// Returns the groups and the number of rows left out as wrong.
pub fn group(rows: &[BenchRecord]) -> (Vec<BenchGroup>, usize) {
    let mut latest: BTreeMap<BenchKey, BTreeMap<(String, usize), (&str, f64)>> = BTreeMap::new();
    let mut wrong = 0;
    for row in rows {
        if row.wrong > 0 {
            wrong += 1;
            continue;
        }
        let key = BenchKey { ranks: row.ranks, device: row.device.clone(), dtype: row.dtype.clone(), layout: row.layout.clone() };
        let slot = latest.entry(key).or_default().entry((row.strategy.clone(), row.size)).or_insert((&row.date, row.busbw));
        if row.date.as_str() >= slot.0 {
            *slot = (&row.date, row.busbw);
        }
    }
    let groups = latest
        .into_iter()
        .map(|(key, points)| {
            let mut series: BTreeMap<String, Vec<(usize, f64)>> = BTreeMap::new();
            for ((strategy, size), (_, busbw)) in points {
                series.entry(strategy).or_default().push((size, busbw));
            }
            BenchGroup { key, series }
        })
        .collect();
    (groups, wrong)
}

/// A byte count as the benchmark prints sizes: 512, 4K, 256M, 1G (binary units).
pub fn human_bytes(bytes: f64) -> String {
    const UNITS: [(f64, &str); 3] = [(1073741824.0, "G"), (1048576.0, "M"), (1024.0, "K")];
    for (unit, suffix) in UNITS {
        if bytes >= unit {
            let v = bytes / unit;
            return if v.fract() == 0.0 { format!("{v}{suffix}") } else { format!("{v:.1}{suffix}") };
        }
    }
    format!("{bytes}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(strategy: &str, size: usize, busbw: f64, date: &str) -> BenchRecord {
        BenchRecord {
            size,
            dtype: "float".into(),
            strategy: strategy.into(),
            layout: "single".into(),
            busbw,
            wrong: 0,
            ranks: 4,
            device: "cpu".into(),
            date: date.into(),
        }
    }

    #[test]
    fn groups_by_configuration_and_keeps_the_latest_row_per_size() {
        let old = "2025-01-01T00:00:00Z";
        let new = "2025-01-02T00:00:00Z";
        let rows = vec![
            row("ring", 4096, 1.0, new),
            row("ring", 4096, 9.0, old),
            row("ring", 1024, 0.5, old),
            row("allreduce", 1024, 0.7, old),
            BenchRecord { ranks: 2, ..row("ring", 1024, 0.4, old) },
            BenchRecord { dtype: "half".into(), ..row("ring", 1024, 0.3, old) },
            BenchRecord { wrong: 3, ..row("ring", 8192, 5.0, new) },
        ];
        let (groups, wrong) = group(&rows);
        assert_eq!(wrong, 1);
        let keys: Vec<(usize, &str)> = groups.iter().map(|g| (g.key.ranks, g.key.dtype.as_str())).collect();
        assert_eq!(keys, vec![(2, "float"), (4, "float"), (4, "half")]);
        let four = &groups[1];
        assert_eq!(four.series["ring"], vec![(1024, 0.5), (4096, 1.0)]);
        assert_eq!(four.series["allreduce"], vec![(1024, 0.7)]);
        assert_eq!(four.key.slug(), "busbw-4ranks-cpu-float-single");
    }

    #[test]
    fn sizes_read_like_the_benchmark_prints_them() {
        assert_eq!(human_bytes(512.0), "512");
        assert_eq!(human_bytes(4096.0), "4K");
        assert_eq!(human_bytes(256.0 * 1048576.0), "256M");
        assert_eq!(human_bytes(1536.0), "1.5K");
        assert_eq!(human_bytes(1073741824.0), "1G");
    }
}
