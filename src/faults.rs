//! Fault injection for the reliability tests, from `HPC_TRAIN_FAULT`:
//! a comma-separated list of `KIND@RANK:STEP[:SECONDS]`, where KIND is
//! - `nan`: that rank's loss becomes NaN at that step (a diverging run),
//! - `nangrad`: that rank's gradients become NaN at that step while its loss stays finite (the
//!   gradient check during an overlapped backward),
//! - `exit`: that rank exits abruptly at that step, without MPI_Finalize (a crash),
//! - `stall`: that rank sleeps SECONDS before its exchange at that step (a hung node),
//! - `stall-after`: that rank sleeps SECONDS after its exchange at that step (a node lost
//!   between two exchanges: the others wait for it in the small collectives that follow),
//! - `setup`: that rank's set-up fails after the exchange strategy is built (STEP is ignored;
//!   an error every rank agrees on while communication threads run),
//! - `term`: that rank sends itself SIGTERM during set-up, before the data is opened (STEP is
//!   ignored; a stop requested while the job starts).
//!
//! Nothing happens when the variable is unset; a malformed value is an error.

use std::time::Duration;

use crate::error::{Error, Result};

pub const FAULT_ENV: &str = "HPC_TRAIN_FAULT";

#[derive(Clone, Debug, PartialEq)]
pub enum Fault {
    Nan,
    NanGrad,
    Setup,
    Term,
    Exit,
    Stall(Duration),
    StallAfter(Duration),
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Faults(Vec<(Fault, i32, u64)>);

impl Faults {
    pub fn from_env() -> Result<Faults> {
        match std::env::var(FAULT_ENV) {
            Ok(spec) if !spec.trim().is_empty() => Faults::parse(&spec),
            _ => Ok(Faults::default()),
        }
    }

    pub fn parse(spec: &str) -> Result<Faults> {
        let bad = |item: &str| Error::usage(format!("{FAULT_ENV}: {item:?} is not KIND@RANK:STEP[:SECONDS] (KIND nan, nangrad, exit, stall, stall-after, setup or term)"));
        let mut out = Vec::new();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (kind, at) = item.split_once('@').ok_or_else(|| bad(item))?;
            let parts: Vec<&str> = at.split(':').collect();
            let rank: i32 = parts.first().and_then(|r| r.parse().ok()).ok_or_else(|| bad(item))?;
            let step: u64 = parts.get(1).and_then(|s| s.parse().ok()).ok_or_else(|| bad(item))?;
            let fault = match (kind, parts.get(2)) {
                ("nan", None) => Fault::Nan,
                ("nangrad", None) => Fault::NanGrad,
                ("setup", None) => Fault::Setup,
                ("term", None) => Fault::Term,
                ("exit", None) => Fault::Exit,
                ("stall", Some(secs)) => Fault::Stall(Duration::from_secs_f64(secs.parse().map_err(|_| bad(item))?)),
                ("stall-after", Some(secs)) => Fault::StallAfter(Duration::from_secs_f64(secs.parse().map_err(|_| bad(item))?)),
                _ => return Err(bad(item)),
            };
            out.push((fault, rank, step));
        }
        Ok(Faults(out))
    }

    /// The fault planned for `rank` at `step`, if any.
    pub fn at(&self, rank: i32, step: u64) -> Option<&Fault> {
        self.0.iter().find(|(f, r, s)| *r == rank && *s == step && !matches!(f, Fault::Setup | Fault::Term)).map(|(f, _, _)| f)
    }

    /// Whether `rank` is to send itself SIGTERM during set-up.
    pub fn terminates_in_setup(&self, rank: i32) -> bool {
        self.0.iter().any(|(f, r, _)| *f == Fault::Term && *r == rank)
    }

    /// Whether `rank`'s set-up is to fail.
    pub fn setup_fails(&self, rank: i32) -> bool {
        self.0.iter().any(|(f, r, _)| *f == Fault::Setup && *r == rank)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects() {
        let f = Faults::parse("nan@1:3, stall@0:2:1.5,exit@2:7,nangrad@0:4,setup@1:0,stall-after@1:9:2").unwrap();
        assert_eq!(f.at(0, 4), Some(&Fault::NanGrad));
        assert!(f.setup_fails(1) && !f.setup_fails(0));
        let term = Faults::parse("term@1:0").unwrap();
        assert!(term.terminates_in_setup(1) && !term.terminates_in_setup(0) && !f.terminates_in_setup(1));
        assert_eq!(term.at(1, 0), None);
        assert_eq!(f.at(1, 0), None);
        assert_eq!(f.at(1, 3), Some(&Fault::Nan));
        assert_eq!(f.at(0, 2), Some(&Fault::Stall(Duration::from_millis(1500))));
        assert_eq!(f.at(2, 7), Some(&Fault::Exit));
        assert_eq!(f.at(2, 6), None);
        assert_eq!(f.at(1, 9), Some(&Fault::StallAfter(Duration::from_secs(2))));
        for bad in ["nan", "nan@x:1", "boom@1:1", "stall@1:1", "stall-after@1:1", "nan@1:2:3"] {
            assert!(Faults::parse(bad).is_err(), "{bad}");
        }
    }
}
