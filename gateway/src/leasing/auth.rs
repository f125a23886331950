//! Workers' logins and links: a lease token checked (once) or a listed
//! static worker's own, a token re-armed when its worker's link drops, and
//! what a worker's registration or disconnection does to its lease. The
//! bookkeeping of absence is the [`LeaseBook`](super::book::LeaseBook)'s;
//! the QUIC server (`server/worker.rs`) asks through [`Leasing`].
//!
//! [`Leasing`]: super::Leasing

use tidegate_lease::table::ClaimError;
use tidegate_lease::{LeaseId, LeaseState, LeaseToken};
use tracing::{debug, info, warn};

use super::book::LedgerWrite;
use super::shell::Shell;
use super::{LeaseSource, Refusal, WorkerPass};

impl<P: LeaseSource> Shell<P> {
    /// Checks a worker's `Hello`: a leased worker (`lease-<id>`) by its
    /// lease's one-time token, anything else as a listed static worker.
    pub(super) fn authenticate(
        &mut self,
        name: &str,
        token: &str,
    ) -> Option<Result<WorkerPass, Refusal>> {
        let Some(n) = name.strip_prefix("lease-") else {
            return self.authenticate_static(name, token);
        };
        let Ok(n) = n.parse::<u64>() else {
            return Some(Err(format!(
                "a leased worker's name is lease-<id>; '{name}' is not"
            )
            .into()));
        };
        let id = LeaseId(n);
        if self.book.is_acquiring(id) {
            // its worker came up before its provider's answer did
            return Some(Err(Refusal::later(format!(
                "lease {id} is still being acquired"
            ))));
        }
        match self.table.claim(id, &LeaseToken::from_secret(token)) {
            Ok(()) => {
                if let Err(e) = self.ledger.set_token_claimed(id, true) {
                    warn!(lease = %id, "recording the token claim: {e}");
                }
                Some(Ok(WorkerPass::Lease(id)))
            }
            // A second connection while the first still holds the claim:
            // the first may be a dead link not yet noticed (heartbeats end
            // it within seconds), so the worker may retry.
            Err(e @ ClaimError::AlreadyClaimed(_)) => Some(Err(Refusal::later(e.to_string()))),
            Err(e) => Some(Err(e.to_string().into())),
        }
    }

    /// A listed static worker connects with its own token, bound to a lease
    /// or not, one connection at a time; `None` for a name not listed.
    fn authenticate_static(
        &mut self,
        name: &str,
        token: &str,
    ) -> Option<Result<WorkerPass, Refusal>> {
        let p = self.provider.listed()?;
        if !p.is_listed(name) {
            return None;
        }
        let token = LeaseToken::from_secret(token);
        if !p.token_matches(name, &token) {
            return Some(Err(format!(
                "static worker '{name}': its token does not match its token_sha256 in [[leasing.static_workers]]"
            )
            .into()));
        }
        if self.static_links.contains_key(name) {
            return Some(Err(Refusal::later(format!(
                "static worker '{name}' is already connected; one connection at a time (retry once the old connection has ended)"
            ))));
        }
        let bound = p.bound_lease(name);
        self.static_links.insert(name.to_string(), false);
        if let Some(lease) = bound {
            // its lease's token is the worker's own: claimed by this link
            match self.table.claim(lease, &token) {
                Ok(()) => {
                    if let Err(e) = self.ledger.set_token_claimed(lease, true) {
                        warn!(%lease, "recording the token claim: {e}");
                    }
                }
                Err(e) => debug!(%lease, "static worker's claim: {e}"),
            }
        }
        Some(Ok(WorkerPass::Static(name.to_string())))
    }

    /// A process or Slurm worker's connection is gone while its lease
    /// lives (its link dropped, or the gateway lost its heartbeats): its
    /// token is re-armed so that the same worker may redial and register
    /// again under the same lease instead of exiting on "already used" and
    /// wasting the paid block. Only that lease's token is accepted, and
    /// only for one connection at a time: the claim is re-armed once the
    /// previous connection has gone. If the worker is really gone, its
    /// provider reports the end.
    fn rearm(&mut self, lease: LeaseId) {
        if self.state(lease).is_none_or(|s| s.is_ended()) {
            return;
        }
        match self.table.rearm_claim(lease) {
            Ok(()) => {
                debug!(%lease, "token re-armed: its worker may register again");
                if let Err(e) = self.ledger.set_token_claimed(lease, false) {
                    warn!(%lease, "recording the re-armed token: {e}");
                }
            }
            Err(e) => debug!(%lease, "token not re-armed: {e}"),
        }
    }

    /// The lease's worker registered (its models are warm): `ready`.
    pub(super) fn lease_registered(&mut self, lease: LeaseId) {
        self.book.worker_back(lease);
        let now = self.now_ms();
        if self.state(lease) == Some(LeaseState::Starting) {
            self.write(lease, LedgerWrite::Ready { at: now });
            let _ = self.table.transition(lease, LeaseState::Ready);
            info!(%lease, "lease ready: its worker registered");
            self.backoff.reset();
        }
        if let Some(p) = self.provider.listed()
            && let Err(e) = p.worker_registered(lease)
        {
            debug!(%lease, "static worker registered: {e}");
        }
        self.update_metrics(now);
    }

    /// The leased worker of `lease` disconnected: a static worker's lease
    /// ends (its link is all we know of it); any other's token is re-armed
    /// and, if it was ready, it is absent until the worker registers again.
    pub(super) fn lease_disconnected(&mut self, lease: LeaseId) {
        info!(%lease, "leased worker disconnected");
        if let Some(p) = self.provider.listed_mut() {
            // a static worker's link is all we know of it: losing
            // it ends the lease, and frees the worker to be bound
            // again when it returns
            if let Err(e) = p.worker_disconnected(lease) {
                debug!(%lease, "static worker disconnected: {e}");
            }
        } else {
            self.rearm(lease);
            let (state, now) = (self.state(lease), self.mono());
            self.book.worker_gone(lease, state, now);
        }
    }

    /// The static worker `name` registered: the lease bound to it, if any,
    /// is ready.
    pub(super) fn static_registered(&mut self, name: &str) {
        if let Some(registered) = self.static_links.get_mut(name) {
            *registered = true;
        }
        let bound = self.provider.listed().and_then(|p| p.bound_lease(name));
        match bound {
            Some(lease) => self.lease_registered(lease),
            None => {
                info!(worker = %name, "static worker registered unbound; it waits for a lease")
            }
        }
    }

    /// The static worker `name` disconnected: the lease bound to it, if
    /// any, is reported lost by its provider, and the worker may be bound
    /// again when it returns.
    pub(super) fn static_disconnected(&mut self, name: &str) {
        self.static_links.remove(name);
        if let Some(p) = self.provider.listed_mut()
            && let Some(lease) = p.bound_lease(name)
        {
            // a static worker's link is all we know of it: losing
            // it ends the lease (the provider reports it lost), and
            // frees the worker to be bound again when it returns
            info!(%lease, worker = %name, "static worker disconnected; its lease is lost");
            if let Err(e) = p.worker_disconnected(lease) {
                debug!(%lease, "static worker disconnected: {e}");
            }
        } else {
            info!(worker = %name, "unbound static worker disconnected");
        }
    }
}
