//! Who serves what: which ranks serve and which work ([`Roles`]), and which server holds each
//! parameter tensor ([`partition`], balanced in bytes). Pure arithmetic, tested without MPI.

use mpi::topology::Rank;

use crate::error::{Error, Result};
use crate::exchange::config::{worker_count, PsConfig, RoleOptions, StrategyKind};
use crate::plan::buckets::{Bucket, Slot};

/// Server of every tensor: largest tensors first, each to the server holding the fewest bytes
/// so far (ties to the lowest index), so that servers carry near-equal traffic.
pub fn partition(sizes: &[usize], servers: usize) -> Result<Vec<usize>> {
    if servers > sizes.len() {
        return Err(Error::usage(format!(
            "{servers} parameter servers but the model has {} parameter tensors: each server needs at least one",
            sizes.len()
        )));
    }
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by(|&a, &b| sizes[b].cmp(&sizes[a]).then(a.cmp(&b)));
    let mut load = vec![0usize; servers];
    let mut server_of = vec![0; sizes.len()];
    for t in order {
        let s = (0..servers).min_by_key(|&s| (load[s], s)).expect("at least one server");
        server_of[t] = s;
        load[s] += sizes[t];
    }
    Ok(server_of)
}

/// Each server's tensors as a bucket (slots in tensor order).
pub(super) fn server_buckets(sizes: &[usize], server_of: &[usize], servers: usize) -> Vec<Bucket> {
    let mut buckets: Vec<Bucket> = (0..servers).map(|_| Bucket { slots: Vec::new(), len: 0 }).collect();
    for (t, &s) in server_of.iter().enumerate() {
        let b = &mut buckets[s];
        b.slots.push(Slot { tensor: t, offset: b.len, len: sizes[t] });
        b.len += sizes[t];
    }
    buckets
}

/// Who serves and who works.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Roles {
    pub servers: Vec<Rank>,
    pub workers: Vec<Rank>,
}

impl Roles {
    pub fn new(ranks: usize, config: &PsConfig) -> Result<Roles> {
        let all: Vec<Rank> = (0..ranks as Rank).collect();
        if config.colocate {
            return Ok(Roles { servers: all.clone(), workers: all });
        }
        let workers = worker_count(StrategyKind::Ps, ranks, &RoleOptions { servers: config.servers, colocate: false })?;
        Ok(Roles { servers: all[workers..].to_vec(), workers: all[..workers].to_vec() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_balances_bytes() {
        let sizes = [100, 10, 60, 50, 5, 5];
        let server_of = partition(&sizes, 2).unwrap();
        let mut load = [0usize; 2];
        for (t, &s) in server_of.iter().enumerate() {
            load[s] += sizes[t];
        }
        assert_eq!(load, [115, 115]);
        assert!(partition(&sizes, 7).unwrap_err().to_string().contains("6 parameter tensors"));
    }

    #[test]
    fn roles_leave_workers_or_fail() {
        let cfg = PsConfig { servers: 2, ..PsConfig::default() };
        let roles = Roles::new(5, &cfg).unwrap();
        assert_eq!(roles.workers, vec![0, 1, 2]);
        assert_eq!(roles.servers, vec![3, 4]);
        assert!(Roles::new(2, &cfg).is_err());
        let colocated = Roles::new(3, &PsConfig { colocate: true, ..cfg }).unwrap();
        assert_eq!(colocated.servers, vec![0, 1, 2]);
        assert_eq!(colocated.workers, vec![0, 1, 2]);
    }

    #[test]
    fn each_server_packs_its_tensors_in_tensor_order() {
        let sizes = [100, 10, 60, 50, 5, 5];
        let server_of = partition(&sizes, 2).unwrap();
        let buckets = server_buckets(&sizes, &server_of, 2);
        for (s, bucket) in buckets.iter().enumerate() {
            let mine: Vec<usize> = (0..sizes.len()).filter(|&t| server_of[t] == s).collect();
            assert_eq!(bucket.slots.iter().map(|slot| slot.tensor).collect::<Vec<_>>(), mine, "server {s}: its tensors, in tensor order");
            let mut offset = 0;
            for slot in &bucket.slots {
                assert_eq!((slot.offset, slot.len), (offset, sizes[slot.tensor]), "server {s}: slots follow each other");
                offset += slot.len;
            }
            assert_eq!(bucket.len, offset);
        }
    }
}
