//! Fair shares between edges, of the queue and of the workers.
//!
//! Every configured edge (all connections under one `[[edges]]` name, see
//! [`Event::EdgeJoined`]) is an *account* with a weight. The queue is
//! shared by weight: an account holds at most
//! `Settings::max_queued_per_edge` frames, and when the whole queue
//! (`Settings::max_queued`) is full a frame of an account under its weighted
//! share of it pushes out the least urgent frame of the account furthest
//! over its share; a frame of an account at or over its share is refused
//! (`overloaded`). A batch's frames are picked across accounts by
//! start-time fair queuing (each pick goes to the account that has been
//! served least for its weight; an account that falls idle banks no
//! credit), earliest deadline first within an account; the batch size is
//! still cut to the model's earliest queued deadline (`dispatch.rs`), so
//! every picked frame makes its deadline. A batch is also cut where its
//! next pick would mix accounts with a batch or more queued (a flood) with
//! the others, so an edge within its means never waits for a flood's
//! frames to run beside its own.
//!
//! [`Event::EdgeJoined`]: super::Event::EdgeJoined

use std::collections::HashSet;

use super::{EdgeId, FrameId, Scheduler, WorkerId, queue::Queued};

/// Who a frame counts to for the fair shares of the queue and of the
/// workers: its connection's configured edge name, or the connection itself
/// when it never joined (tests, a frame that beat its edge's join).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) enum Account {
    /// A configured edge, all its connections together.
    Named(std::sync::Arc<str>),
    /// A connection that never joined.
    Connection(EdgeId),
}

/// An account's weight, backlog and service.
#[derive(Debug)]
pub(super) struct Share {
    pub(super) weight: u32,
    /// Its frames queued, all models.
    pub(super) queued: usize,
    /// Its connections joined and not gone.
    pub(super) connections: usize,
    /// Start-time fair queuing tag: [`VT_UNIT`] / `weight` per frame
    /// dispatched; never behind the scheduler's virtual time while it has
    /// frames queued.
    pub(super) vtime: u64,
}

/// Virtual time one frame costs an account of weight 1. A weight of `w`
/// pays `VT_UNIT / w`; weights are at most [`MAX_WEIGHT`], so the rounding
/// is under a thousandth of a frame.
const VT_UNIT: u64 = 1_000_000_000;

/// The largest weight an edge may have (config validation holds to it).
pub const MAX_WEIGHT: u32 = 1_000_000;

impl Scheduler {
    /// The account a connection's frames count to.
    pub(super) fn account_of(&self, edge: EdgeId) -> Account {
        self.accounts
            .get(&edge)
            .cloned()
            .unwrap_or(Account::Connection(edge))
    }

    /// Frames `account` has queued, all models.
    pub(super) fn queued_of(&self, account: &Account) -> usize {
        self.shares.get(account).map_or(0, |s| s.queued)
    }

    /// `account`'s weighted share of the whole queue: `max_queued` split by
    /// weight among the accounts with frames queued and `account` itself.
    pub(super) fn queue_share(&self, account: &Account) -> usize {
        let weight = |a: &Account| self.shares.get(a).map_or(1, |s| s.weight.max(1)) as u128;
        let others: u128 = self
            .shares
            .iter()
            .filter(|(a, s)| s.queued > 0 && *a != account)
            .map(|(_, s)| s.weight.max(1) as u128)
            .sum();
        let own = weight(account);
        (self.limits.max_queued as u128 * own / (own + others)) as usize
    }

    /// The least urgent queued frame (latest deadline, newest of equals) of
    /// the account furthest over its weighted share, if that is not
    /// `account`.
    pub(super) fn push_out_victim(&self, account: &Account) -> Option<FrameId> {
        let (over, _) = self
            .shares
            .iter()
            .filter(|(_, s)| s.queued > 0)
            // queued / weight, compared without division
            .max_by(|(_, a), (_, b)| {
                (a.queued as u128 * b.weight.max(1) as u128)
                    .cmp(&(b.queued as u128 * a.weight.max(1) as u128))
            })?;
        if over == account {
            return None;
        }
        self.by_account
            .values()
            .filter_map(|sets| sets.get(over)?.last().copied())
            .max()
            .map(|(_, id)| id)
    }

    /// Takes up to `n` queued frames of `model` for one batch, earliest
    /// deadline first. Each pick goes to the account with the lowest
    /// start-time fair queuing tag (served least for its weight; the most
    /// urgent head among equals) and takes that account's most urgent
    /// frame that `worker` did not fail before. Every frame of the model
    /// has a deadline at or after the model's earliest, which the caller cut
    /// the batch to, so whichever frames are picked make their deadlines.
    pub(super) fn pick_fair(&mut self, model: &str, n: usize, worker: WorkerId) -> Vec<Queued> {
        let mut picked = Vec::with_capacity(n);
        // An account with at least a batch of this model queued is
        // backlogged. A batch is cut where its next pick would be of the
        // other kind (backlogged or not) than its first: the picks keep
        // their fair order, but a frame of an edge within its means never
        // runs in a batch filled with a flood's frames, nor a flood's in
        // one with such a frame.
        // One account alone (the common case) has nothing to be kept
        // apart from: no set is built.
        let backlogged: HashSet<Account> = match self.by_account.get(model) {
            Some(sets) if sets.len() > 1 => sets
                .iter()
                .filter(|(_, set)| set.len() >= n)
                .map(|(a, _)| a.clone())
                .collect(),
            _ => HashSet::new(),
        };
        let mut kind: Option<bool> = None;
        while picked.len() < n {
            let Some(sets) = self.by_account.get(model) else {
                break;
            };
            // A frame this worker failed goes to another one.
            let sendable = |id: &FrameId| {
                self.queued
                    .get(id)
                    .is_none_or(|q| q.failed_on != Some(worker))
            };
            let next = sets
                .iter()
                .filter_map(|(account, set)| {
                    let &(deadline, id) = set.iter().find(|(_, id)| sendable(id))?;
                    let tag = self.shares.get(account).map_or(self.vnow, |s| s.vtime);
                    Some(((tag, deadline, id), account))
                })
                .min_by_key(|(key, _)| *key)
                .map(|((_, _, id), account)| (account.clone(), id));
            let Some((account, id)) = next else {
                break;
            };
            let is_backlogged = backlogged.contains(&account);
            if *kind.get_or_insert(is_backlogged) != is_backlogged {
                break;
            }
            if let Some(share) = self.shares.get_mut(&account) {
                self.vnow = self.vnow.max(share.vtime);
                share.vtime = share.vtime.max(self.vnow) + VT_UNIT / u64::from(share.weight.max(1));
            }
            picked.push(self.unqueue(id).expect("queued frame is indexed"));
        }
        picked.sort_unstable_by_key(|q| (q.arrival.deadline, q.arrival.id));
        picked
    }
}
