//! `hpc-train model fit` (the cost model's unknowns from measured bench rows) and
//! `hpc-train project` (scaling tables for clusters larger than the one measured, from a
//! cluster profile, with every prediction checked against the measurements it is given).
//!
//! The formulas are cost.rs's; these files read rows, fit, and lay out results. Projected runs
//! are written as run records marked `projected` and handed to `hpc-train report`, so that they
//! come out in the report's own tables and plots.
//!
//! `predict.rs` holds what both share (the bench rows, one exchange's prediction and its
//! residual); `fit.rs` the fit and `projection.rs` the projection import it, not each other.

mod fit;
mod predict;
mod projection;

pub use fit::{fit, FitArgs};
pub use projection::{project, ProjectArgs};
