//! Helpers of the lease provider tests that run a stand-in worker
//! (`lease/tests/slurm_provider.rs`, `kubernetes_provider.rs`): the worker
//! script, lease specs, bounded waits for provider events and files.
//! Feature `provider`.

use std::fmt;
use std::path::Path;
use std::time::Duration;

use tidegate_lease::catalog::{Catalog, Tier};
use tidegate_lease::ledger::{Ledger, NewLease};
use tidegate_lease::lifecycle::EndReason;
use tidegate_lease::provider::{LeaseSpec, Provider, ProviderEvent, wall_clock_ms};
use tidegate_lease::table::{LeaseId, LeaseToken};
use tokio::sync::mpsc;

/// Longest any wait may take: it only guards against a hang.
pub const GUARD: Duration = Duration::from_secs(60);

/// The stand-in worker: on SIGTERM it finishes its work (half a second),
/// writes a `drained` file and exits 0, as the worker drains. The trap is
/// set before it records its environment, which the tests wait for.
pub const WORKER: &str = r#"trap 'sleep 0.5; echo drained > "$OUT/lease-$TIDEGATE_LEASE_ID.drained"; exit 0' TERM
env > "$OUT/lease-$TIDEGATE_LEASE_ID.env"
while :; do sleep 0.1; done"#;

/// A lease of the default catalog's `instance`, with a fresh token.
pub fn spec(id: u64, tier: Tier, instance: &str) -> LeaseSpec {
    LeaseSpec {
        lease: LeaseId(id),
        token: LeaseToken::generate().unwrap(),
        instance: Catalog::default_catalog().get(instance).unwrap().clone(),
        tier,
        preempt_after: None,
    }
}

/// The next provider event, within the guard.
pub async fn next_event(rx: &mut mpsc::Receiver<ProviderEvent>) -> ProviderEvent {
    tokio::time::timeout(GUARD, rx.recv())
        .await
        .expect("a provider event within the guard")
        .expect("the event channel is open")
}

/// The next event, which must be the end of `want`: its reason and detail.
pub async fn ended(rx: &mut mpsc::Receiver<ProviderEvent>, want: LeaseId) -> (EndReason, String) {
    match next_event(rx).await {
        ProviderEvent::Ended {
            lease,
            reason,
            detail,
        } if lease == want => (reason, detail),
        other => panic!("expected {want} to end, got {other:?}"),
    }
}

/// Polls `done` until it holds; past the guard, fails with `what` and
/// `context()` (the cluster's state).
pub async fn wait_for(what: &str, context: impl Fn() -> String, done: impl FnMut() -> bool) {
    crate::eventually(Explained(what, context), GUARD, done).await
}

/// `what`, then `context()` on the next lines, computed only when shown.
struct Explained<'a, F>(&'a str, F);

impl<F: Fn() -> String> fmt::Display for Explained<'_, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}\n{}", self.0, (self.1)())
    }
}

/// The environment the stand-in worker of `lease` recorded, once complete.
pub fn env_of(out: &Path, lease: u64) -> Option<String> {
    std::fs::read_to_string(out.join(format!("lease-{lease}.env")))
        .ok()
        .filter(|s| s.contains("TIDEGATE_LEASE_TOKEN="))
}

/// The value of `name` in a recorded environment.
pub fn var<'a>(env: &'a str, name: &str) -> Option<&'a str> {
    env.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix('=')))
}

/// Acquires an on-demand `h100` lease through `p` as the gateway does:
/// recorded in `ledger` (as `provider`) with its token first, marked
/// starting with the provider's data after. `gpus` overrides the type's
/// count. Returns the provider data.
pub async fn acquire_recorded(
    p: &mut impl Provider,
    ledger: &mut Ledger,
    provider: &str,
    gpus: Option<u32>,
) -> String {
    let catalog = Catalog::default_catalog();
    let token = LeaseToken::generate().unwrap();
    let now = wall_clock_ms();
    let id = ledger
        .insert_requested(&NewLease {
            provider,
            model: Some("blazeface"),
            instance: catalog.get("h100").unwrap(),
            tier: Tier::OnDemand,
            currency: &catalog.currency,
            requested_at: now,
            token: Some(token.digest()),
        })
        .unwrap();
    let mut s = spec(id.0, Tier::OnDemand, "h100");
    if let Some(g) = gpus {
        s.instance.gpus = g;
    }
    s.token = token;
    let a = p.acquire(s).await.unwrap();
    ledger
        .mark_starting(a.lease, now, a.pid, a.provider_data.as_deref())
        .unwrap();
    a.provider_data.expect("provider data for adoption")
}
