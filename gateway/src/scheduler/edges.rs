//! Edge connections as the scheduler sees them: a connection that joins
//! under a configured edge name counts to that name's account
//! (`fair_share.rs`); when a connection goes ([`Event::EdgeGone`]) its
//! queued frames are dropped (`edge_gone`), since their results would have
//! nowhere to go, and so is a frame of it that trails the close. Its frames
//! already on a worker finish as usual.
//!
//! [`Event::EdgeGone`]: super::Event::EdgeGone

use tidegate_protocol::{ShedReason, Status};

use super::fair_share::{Account, MAX_WEIGHT, Share};
use super::{Action, EdgeId, FrameId, Micros, Scheduler};

/// Gone edge connections remembered, so that a frame that trails its
/// connection's close is dropped too: the shell's frame and close messages
/// come from separate tasks, and a trailing frame arrives within moments.
pub(super) const GONE_EDGES_KEPT: usize = 1024;

impl Scheduler {
    /// A connection authenticated as the configured edge `name`.
    pub(super) fn join_edge(&mut self, edge: EdgeId, name: String, weight: u32) {
        let account = Account::Named(name.into());
        if let Some(old) = self.accounts.insert(edge, account.clone())
            && let Some(s) = self.shares.get_mut(&old)
        {
            // Joined twice: the old account loses the connection.
            s.connections = s.connections.saturating_sub(1);
        }
        let share = self.shares.entry(account).or_insert(Share {
            weight: 1,
            queued: 0,
            connections: 0,
            vtime: self.vnow,
        });
        share.weight = weight.clamp(1, MAX_WEIGHT);
        share.connections += 1;
    }

    /// A connection closed: its queued frames end `edge_gone`, and so will
    /// any of its frames that arrive later.
    pub(super) fn edge_gone(&mut self, now: Micros, edge: EdgeId, out: &mut Vec<Action>) {
        // Its frames count to its account, or to itself if they came
        // before it joined.
        let accounts = [self.account_of(edge), Account::Connection(edge)];
        let mut doomed: Vec<FrameId> = self
            .by_account
            .values()
            .flat_map(|sets| accounts.iter().filter_map(|a| sets.get(a)))
            .flatten()
            .map(|(_, id)| *id)
            .filter(|id| self.queued.get(id).is_some_and(|q| q.arrival.edge == edge))
            .collect();
        doomed.sort_unstable();
        doomed.dedup();
        for id in doomed {
            let q = self.unqueue(id).expect("queued frame is indexed");
            self.complete(now, &q, Status::Shed(ShedReason::EdgeGone), out);
        }
        if let Some(account) = self.accounts.remove(&edge)
            && let Some(s) = self.shares.get_mut(&account)
        {
            s.connections = s.connections.saturating_sub(1);
            if s.connections == 0 && s.queued == 0 {
                self.shares.remove(&account);
            }
        }
        self.age_floors.retain(|(e, _), _| *e != edge);
        if self.gone_set.insert(edge) {
            if self.gone.len() >= GONE_EDGES_KEPT
                && let Some(old) = self.gone.pop_front()
            {
                self.gone_set.remove(&old);
            }
            self.gone.push_back(edge);
        }
    }
}
