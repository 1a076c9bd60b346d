//! Fault injection for the reliability tests, from `HPC_TRAIN_FAULT`:
//! a comma-separated list of `KIND@RANK:STEP[:SECONDS]`, where KIND is
//! - `nan`: that rank's loss becomes NaN at that step (a diverging run),
//! - `nangrad`: that rank's gradients become NaN at that step while its loss stays finite (the
//!   gradient check during an overlapped backward),
//! - `infgrad`: one element of that rank's gradients becomes +inf after the exchange at that
//!   step of an fp16 run (its own slice overflowing, which the ranks that share its parameters
//!   must skip with it),
//! - `exit`: that rank exits abruptly at that step, without MPI_Finalize (a crash),
//! - `stall`: that rank sleeps SECONDS before its exchange at that step (a hung node),
//! - `pace`: that rank sleeps SECONDS before its exchange at that step and at every step after
//!   it (a slow rank; a test that signals a run at a known stage then needs a few slow steps
//!   instead of hundreds of fast ones to be sure to find it still running),
//! - `stall-after`: that rank sleeps SECONDS after its exchange at that step (a node lost
//!   between two exchanges: the others wait for it in the small collectives that follow),
//! - `setup`: that rank's set-up fails after the exchange strategy is built (STEP is ignored;
//!   an error every rank agrees on while communication threads run),
//! - `error`: that rank's forward fails at that step, as an out-of-memory would: in a pipeline,
//!   at the last forward of the stage's schedule, with messages to and from its neighbours in
//!   flight (an error only this rank sees, in the middle of the step).
//! - `term`: that rank sends itself SIGTERM during set-up, before the data is opened (STEP is
//!   ignored; a stop requested while the job starts).
//! - `stall-write`: that rank sleeps SECONDS in the middle of writing its part of the checkpoint
//!   of step STEP (the folder `ckpt-<STEP>`), after the first piece of its part file, so that a
//!   test can kill the job while a checkpoint is half written.
//! - `stall-start`: that rank sleeps SECONDS before MPI's start-up (STEP is ignored), the others
//!   waiting for it inside `MPI_Init_thread`: a rank stopped while the job starts. Read before
//!   MPI exists, with the rank and size the launcher's variables give.
//! - `damage-write`: that rank flips a byte of its part file of the checkpoint of step STEP
//!   once it is written and its CRC-32 taken (data changed on its way to the disk).
//!
//! Every step kind (plain, pipelined, `--zero 3`) honours every kind at the same points, through
//! `train::step::StepFaults`. Nothing happens when the variable is unset; a malformed value, a
//! rank the job does not have, or SECONDS that are not a finite number from 0 to
//! [`MAX_STALL_S`] are refused at set-up.

use std::time::Duration;

use crate::checkpoint::sharded::WriteFault;
use crate::error::{Error, Result};

pub const FAULT_ENV: &str = "HPC_TRAIN_FAULT";

/// Whether `HPC_TRAIN_FAULT` names any fault (a row of plan/compat.rs's table).
pub fn injected() -> bool {
    std::env::var_os(FAULT_ENV).is_some_and(|v| !v.to_string_lossy().trim().is_empty())
}

/// The `stall-start` pause of this process, before MPI's start-up: its rank and the job's size
/// come from the launcher's variables, as MPI does not exist yet. A value that does not parse
/// pauses nothing here; the run's set-up refuses it with the reason.
pub fn stall_before_start_up() {
    let launched = crate::mpi_library::launched_processes();
    let rank = crate::mpi_library::launcher_rank();
    if let Some(pause) = Faults::from_env(launched).ok().and_then(|f| f.start_stall(rank)) {
        eprintln!("rank {rank}: pausing {:.0} s before MPI's start-up (injected fault)", pause.as_secs_f64());
        std::thread::sleep(pause);
    }
}

/// The longest stall a fault may ask for (a day): longer than any test needs, and far inside
/// what `Duration::from_secs_f64` accepts (it panics on a negative, infinite or NaN value).
pub const MAX_STALL_S: f64 = 86_400.0;

#[derive(Clone, Debug, PartialEq)]
pub enum Fault {
    Nan,
    NanGrad,
    InfGrad,
    Setup,
    Term,
    Exit,
    Error,
    Stall(Duration),
    Pace(Duration),
    StallAfter(Duration),
    StallWrite(Duration),
    StallStart(Duration),
    DamageWrite,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Faults(Vec<(Fault, i32, u64)>);

impl Faults {
    /// The faults `HPC_TRAIN_FAULT` asks for in a job of `ranks` ranks.
    pub fn from_env(ranks: i32) -> Result<Faults> {
        match std::env::var(FAULT_ENV) {
            Ok(spec) if !spec.trim().is_empty() => Faults::parse(&spec, ranks),
            _ => Ok(Faults::default()),
        }
    }

    /// Parses `spec` for a job of `ranks` ranks: a fault on a rank the job lacks would silently
    /// never happen, and a test relying on it would pass for the wrong reason.
    pub fn parse(spec: &str, ranks: i32) -> Result<Faults> {
        let bad = |item: &str| Error::usage(format!("{FAULT_ENV}: {item:?} is not KIND@RANK:STEP[:SECONDS] (KIND nan, nangrad, infgrad, exit, error, stall, pace, stall-after, stall-write, damage-write, stall-start, setup or term)"));
        let pause = |item: &str, secs: &str| -> Result<Duration> {
            let secs: f64 = secs.parse().map_err(|_| bad(item))?;
            if !(0.0..=MAX_STALL_S).contains(&secs) {
                return Err(Error::usage(format!("{FAULT_ENV}: {item:?}: SECONDS must be a number from 0 to {MAX_STALL_S}")));
            }
            Ok(Duration::from_secs_f64(secs))
        };
        let mut out = Vec::new();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (kind, at) = item.split_once('@').ok_or_else(|| bad(item))?;
            let parts: Vec<&str> = at.split(':').collect();
            let rank: i32 = parts.first().and_then(|r| r.parse().ok()).ok_or_else(|| bad(item))?;
            let step: u64 = parts.get(1).and_then(|s| s.parse().ok()).ok_or_else(|| bad(item))?;
            let fault = match (kind, parts.get(2), parts.len()) {
                ("nan", None, _) => Fault::Nan,
                ("nangrad", None, _) => Fault::NanGrad,
                ("infgrad", None, _) => Fault::InfGrad,
                ("setup", None, _) => Fault::Setup,
                ("term", None, _) => Fault::Term,
                ("exit", None, _) => Fault::Exit,
                ("error", None, _) => Fault::Error,
                ("damage-write", None, _) => Fault::DamageWrite,
                ("stall", Some(secs), 3) => Fault::Stall(pause(item, secs)?),
                ("pace", Some(secs), 3) => Fault::Pace(pause(item, secs)?),
                ("stall-after", Some(secs), 3) => Fault::StallAfter(pause(item, secs)?),
                ("stall-write", Some(secs), 3) => Fault::StallWrite(pause(item, secs)?),
                ("stall-start", Some(secs), 3) => Fault::StallStart(pause(item, secs)?),
                _ => return Err(bad(item)),
            };
            if !(0..ranks).contains(&rank) {
                return Err(Error::usage(format!("{FAULT_ENV}: {item:?} names rank {rank}, but the job has ranks 0 to {}", ranks - 1)));
            }
            out.push((fault, rank, step));
        }
        Ok(Faults(out))
    }

    /// The fault planned for `rank` at the training step `step`, if any (set-up's and the
    /// checkpoint writes' are asked for apart).
    pub fn at(&self, rank: i32, step: u64) -> Option<&Fault> {
        let exact = self.0.iter().find(|(f, r, s)| *r == rank && *s == step && !matches!(f, Fault::Setup | Fault::Term | Fault::StallWrite(_) | Fault::StallStart(_) | Fault::DamageWrite | Fault::Pace(_)));
        // A pace holds from its step on, below any fault of the step itself.
        let paced = || self.0.iter().find(|(f, r, s)| *r == rank && *s <= step && matches!(f, Fault::Pace(_)));
        exact.or_else(paced).map(|(f, _, _)| f)
    }

    /// The kind of the first fault planned inside a sharded checkpoint write, if any
    /// (`stall-write`, `damage-write`).
    pub fn in_a_sharded_write(&self) -> Option<&'static str> {
        self.0.iter().find_map(|(f, _, _)| match f {
            Fault::StallWrite(_) => Some("stall-write"),
            Fault::DamageWrite => Some("damage-write"),
            _ => None,
        })
    }

    /// How long `rank` is to pause before MPI's start-up.
    pub fn start_stall(&self, rank: i32) -> Option<Duration> {
        self.0.iter().find_map(|(f, r, _)| match f {
            Fault::StallStart(pause) if *r == rank => Some(*pause),
            _ => None,
        })
    }

    /// What `rank` is to do wrong in its part of the checkpoint of step `step`.
    pub fn in_write(&self, rank: i32, step: u64) -> WriteFault {
        self.0
            .iter()
            .find_map(|(f, r, s)| match f {
                Fault::StallWrite(pause) if *r == rank && *s == step => Some(WriteFault::PauseMidway(*pause)),
                Fault::DamageWrite if *r == rank && *s == step => Some(WriteFault::DamageWritten),
                _ => None,
            })
            .unwrap_or_default()
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
        let f = Faults::parse("nan@1:3, stall@0:2:1.5,exit@2:7,nangrad@0:4,setup@1:0,stall-after@1:9:2,error@2:1,infgrad@2:5,stall-write@0:20:3,damage-write@2:10", 3).unwrap();
        assert_eq!(f.in_write(0, 20), WriteFault::PauseMidway(Duration::from_secs(3)));
        assert_eq!((f.in_write(0, 19), f.in_write(1, 20), f.at(0, 20)), (WriteFault::None, WriteFault::None, None), "a write's stall is no step's fault");
        assert_eq!((f.in_write(2, 10), f.at(2, 10)), (WriteFault::DamageWritten, None));
        assert_eq!(f.at(0, 4), Some(&Fault::NanGrad));
        assert!(f.setup_fails(1) && !f.setup_fails(0));
        let term = Faults::parse("term@1:0", 2).unwrap();
        assert!(f.in_a_sharded_write() == Some("stall-write") && term.in_a_sharded_write().is_none());
        assert!(term.terminates_in_setup(1) && !term.terminates_in_setup(0) && !f.terminates_in_setup(1));
        assert_eq!(term.at(1, 0), None);
        assert_eq!(f.at(1, 0), None);
        assert_eq!(f.at(1, 3), Some(&Fault::Nan));
        assert_eq!(f.at(0, 2), Some(&Fault::Stall(Duration::from_millis(1500))));
        assert_eq!(f.at(2, 7), Some(&Fault::Exit));
        assert_eq!(f.at(2, 6), None);
        assert_eq!(f.at(1, 9), Some(&Fault::StallAfter(Duration::from_secs(2))));
        assert_eq!(f.at(2, 1), Some(&Fault::Error));
        assert_eq!(f.at(2, 5), Some(&Fault::InfGrad));
        // A pace holds from its step on, and a fault of the step itself comes first.
        let paced = Faults::parse("pace@1:4:0.1,nan@1:6", 2).unwrap();
        let pace = Some(&Fault::Pace(Duration::from_millis(100)));
        assert_eq!((paced.at(1, 3), paced.at(1, 4), paced.at(1, 5), paced.at(1, 6), paced.at(1, 60), paced.at(0, 5)), (None, pace, pace, Some(&Fault::Nan), pace, None));
        let start = Faults::parse("stall-start@1:0:30", 2).unwrap();
        assert_eq!((start.start_stall(1), start.start_stall(0), start.at(1, 0)), (Some(Duration::from_secs(30)), None, None), "a start-up stall is no step's fault");
        for bad in ["nan", "nan@x:1", "boom@1:1", "stall@1:1", "stall-after@1:1", "nan@1:2:3", "stall@1:1:2:3", "error@1:1:2", "stall-write@1:1", "stall-start@1:0", "damage-write@1:1:2", "pace@1:1"] {
            assert!(Faults::parse(bad, 3).is_err(), "{bad}");
        }
    }

    /// A fault on a rank the job lacks never happens: refused, not ignored. Seconds that
    /// `Duration::from_secs_f64` would panic on (negative, NaN, infinite, huge) are refused.
    #[test]
    fn refuses_missing_ranks_and_impossible_pauses() {
        let message = |spec: &str| Faults::parse(spec, 2).unwrap_err().to_string();
        assert!(message("nan@7:1").contains("names rank 7, but the job has ranks 0 to 1"), "{}", message("nan@7:1"));
        assert!(message("exit@-1:1").contains("names rank -1"));
        for secs in ["-1", "nan", "NaN", "inf", "1e30", "86401"] {
            let m = message(&format!("stall@0:2:{secs}"));
            assert!(m.contains("SECONDS must be a number from 0 to 86400"), "{secs}: {m}");
            assert!(Faults::parse(&format!("stall-after@0:2:{secs}"), 2).is_err(), "{secs}");
        }
        assert!(Faults::parse("stall@1:2:0,stall@0:1:86400", 2).is_ok());
    }
}
