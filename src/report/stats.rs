//! Statistics of repeated runs of one point: the median with its range, and MLPerf's mean
//! without the fastest and slowest run (MLPerf Training's rule for a result: 5 runs, the
//! extremes dropped, the other 3 averaged).

/// How a point's repeated runs make one figure (`report --statistic`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Statistic {
    /// The median run; with the minimum and maximum beside it.
    #[default]
    Median,
    /// MLPerf's: the mean of the runs less the fastest and the slowest (3 runs or more; with
    /// fewer, the median stands and the report says so).
    Trimmed,
}

impl Statistic {
    pub fn name(self) -> &'static str {
        match self {
            Statistic::Median => "median",
            Statistic::Trimmed => "mean without the fastest and slowest run (MLPerf)",
        }
    }
}

/// The runs of one point reduced: the figure shown, and the spread it rests on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Summary {
    pub runs: usize,
    /// The statistic asked for, or the median where the trimmed mean needs more runs.
    pub value: f64,
    pub median: f64,
    pub min: f64,
    pub max: f64,
    /// Whether `value` is the trimmed mean (false: the median).
    pub trimmed: bool,
}

/// The median of `values` (the mean of the middle two for an even count); None when empty.
pub fn median(values: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 })
}

/// The mean without the smallest and the largest value; None below 3 values (dropping two
/// of two or fewer leaves nothing to average).
pub fn trimmed_mean(values: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.len() < 3 {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let inner = &v[1..v.len() - 1];
    Some(inner.iter().sum::<f64>() / inner.len() as f64)
}

/// `values` reduced by `statistic`; None when there is no finite value.
pub fn summarise(values: &[f64], statistic: Statistic) -> Option<Summary> {
    let median = median(values)?;
    let finite = values.iter().copied().filter(|x| x.is_finite());
    let (min, max) = finite.clone().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| (lo.min(x), hi.max(x)));
    let trimmed = match statistic {
        Statistic::Trimmed => trimmed_mean(values),
        Statistic::Median => None,
    };
    Some(Summary { runs: finite.count(), value: trimmed.unwrap_or(median), median, min, max, trimmed: trimmed.is_some() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_takes_the_middle_and_ignores_order() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[7.0]), Some(7.0));
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[f64::NAN, 5.0]), Some(5.0));
    }

    #[test]
    fn the_trimmed_mean_drops_the_fastest_and_slowest() {
        // MLPerf's 5 runs: 100 and 200 dropped, the mean of 110, 120, 130.
        assert_eq!(trimmed_mean(&[200.0, 110.0, 100.0, 130.0, 120.0]), Some(120.0));
        assert_eq!(trimmed_mean(&[1.0, 50.0, 2.0]), Some(2.0));
        assert_eq!(trimmed_mean(&[1.0, 2.0]), None);
    }

    #[test]
    fn a_summary_gives_the_range_and_says_which_statistic_it_holds() {
        let s = summarise(&[10.0, 30.0, 20.0, 100.0], Statistic::Median).unwrap();
        assert_eq!((s.runs, s.value, s.median, s.min, s.max, s.trimmed), (4, 25.0, 25.0, 10.0, 100.0, false));
        let t = summarise(&[10.0, 30.0, 20.0, 100.0], Statistic::Trimmed).unwrap();
        assert_eq!((t.value, t.trimmed), (25.0, true));
        // Two runs: the trimmed mean cannot be had; the median stands, marked as such.
        let two = summarise(&[10.0, 20.0], Statistic::Trimmed).unwrap();
        assert_eq!((two.value, two.trimmed), (15.0, false));
        assert!(summarise(&[], Statistic::Median).is_none());
    }
}
