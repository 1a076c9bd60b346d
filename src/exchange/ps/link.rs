//! The parameter server's messages: their tags, and the two communicators they travel on.
//!
//! Messages: PUSH (worker to server, gradients), PULL (server to worker, weights), DONE (worker
//! to server, end of training), FINAL (server to worker, the final weights) and STATE (server
//! to rank 0, its momentum buffer, at checkpoints and at the end), each flat buffer holding the
//! server's tensors in tensor order. Workers send on `up`, servers answer on `down`, so that a
//! colocated server thread and its rank's worker never take each other's messages.

use std::sync::Arc;

use mpi::point_to_point::Status;
use mpi::topology::{Rank, SimpleCommunicator};
use mpi::Tag;

use crate::error::Result;
use crate::raw::{PeerComm, PointToPoint};

pub(super) const PUSH: Tag = 1;
pub(super) const PULL: Tag = 2;
pub(super) const DONE: Tag = 3;
pub(super) const FINAL: Tag = 4;
pub(super) const STATE: Tag = 5;

/// One of the parameter server's two communicators: used by the main thread alone, or shared
/// with a colocated server thread (asynchronous colocated servers only, which is what needs
/// MPI_THREAD_MULTIPLE).
pub(super) enum Link {
    Local(SimpleCommunicator),
    Shared(Arc<PeerComm>),
}

impl Link {
    pub(super) fn new(comm: SimpleCommunicator, shared: bool) -> Result<Link> {
        Ok(if shared {
            Link::Shared(Arc::new(PeerComm::new(comm, mpi::environment::threading_support())?))
        } else {
            Link::Local(comm)
        })
    }

    pub(super) fn shared(&self) -> Option<Arc<PeerComm>> {
        match self {
            Link::Shared(c) => Some(c.clone()),
            Link::Local(_) => None,
        }
    }
}

impl PointToPoint for Link {
    fn send<B: mpi::datatype::Buffer + ?Sized>(&self, to: Rank, buf: &B, tag: Tag) {
        match self {
            Link::Local(c) => c.send(to, buf, tag),
            Link::Shared(c) => c.send(to, buf, tag),
        }
    }
    fn receive_into<B: mpi::datatype::BufferMut + ?Sized>(&self, from: Rank, buf: &mut B, tag: Tag) {
        match self {
            Link::Local(c) => c.receive_into(from, buf, tag),
            Link::Shared(c) => c.receive_into(from, buf, tag),
        }
    }
    fn immediate_send<'a, Sc: mpi::request::Scope<'a>, B: 'a + mpi::datatype::Buffer + ?Sized>(&self, scope: Sc, to: Rank, buf: &'a B, tag: Tag) -> mpi::request::Request<'a, B, Sc> {
        match self {
            Link::Local(c) => c.immediate_send(scope, to, buf, tag),
            Link::Shared(c) => c.immediate_send(scope, to, buf, tag),
        }
    }
    fn immediate_receive_into<'a, Sc: mpi::request::Scope<'a>, B: 'a + mpi::datatype::BufferMut + ?Sized>(&self, scope: Sc, from: Rank, buf: &'a mut B, tag: Tag) -> mpi::request::Request<'a, B, Sc> {
        match self {
            Link::Local(c) => c.immediate_receive_into(scope, from, buf, tag),
            Link::Shared(c) => c.immediate_receive_into(scope, from, buf, tag),
        }
    }
    fn probe(&self, from: Option<Rank>) -> Option<(mpi::point_to_point::Message, Status)> {
        match self {
            Link::Local(c) => c.probe(from),
            Link::Shared(c) => c.probe(from),
        }
    }
}
