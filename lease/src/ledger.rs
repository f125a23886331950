//! The ledger: every lease, every charged billing block and every frame
//! served, in one SQLite file (WAL).
//!
//! Why SQLite: it is one file next to the gateway, survives a crash with
//! WAL, and needs no server. Why blocks: cost is stored as the canonical
//! [`crate::billing::blocks`] of each lease, inserted idempotently
//! (`INSERT OR IGNORE` on `(lease, block)`), so accruing twice charges once,
//! and [`Ledger::recompute_cost`], which derives the same blocks from the
//! lease rows alone, always equals [`Ledger::accrued_cost`] once the ledger
//! has been accrued up to the same instant.
//!
//! The schema is versioned with `PRAGMA user_version`; [`Ledger::open`]
//! applies the missing migrations in order, each in its own transaction, so
//! reopening a file is idempotent.

use std::collections::BTreeMap;
use std::path::Path;

use rusqlite::{Connection, OptionalExtension, params};
use serde::Serialize;

use crate::billing::{self, Granularity, HOUR_MS, Millis};
use crate::catalog::{InstanceType, Money, Tier};
use crate::lifecycle::{EndReason, LeaseState, TransitionError};
use crate::showback::{self, Share, Usage};
use crate::table::{LeaseEntry, LeaseId, LeaseTable, TokenDigest};

/// Schema migrations; `user_version` = how many have been applied.
const MIGRATIONS: &[&str] = &[
    // 1: leases, charged blocks, frames served
    "CREATE TABLE leases (
        id              INTEGER PRIMARY KEY AUTOINCREMENT,
        provider        TEXT    NOT NULL,
        instance_type   TEXT    NOT NULL,
        tier            TEXT    NOT NULL,
        price_micro_per_hour INTEGER NOT NULL CHECK (price_micro_per_hour >= 0),
        currency        TEXT    NOT NULL,
        billing_unit    TEXT    NOT NULL,
        billing_minimum_secs INTEGER NOT NULL,
        state           TEXT    NOT NULL,
        end_reason      TEXT,
        requested_at    INTEGER NOT NULL,
        billing_start   INTEGER,
        ready_at        INTEGER,
        ended_at        INTEGER,
        token_sha256    BLOB,
        token_claimed   INTEGER NOT NULL DEFAULT 0,
        pid             INTEGER,
        provider_data   TEXT
    );
    CREATE TABLE cost_blocks (
        lease_id     INTEGER NOT NULL REFERENCES leases(id),
        block_index  INTEGER NOT NULL,
        block_start  INTEGER NOT NULL,
        block_end    INTEGER NOT NULL,
        charged_at   INTEGER NOT NULL,
        amount_micro INTEGER NOT NULL CHECK (amount_micro >= 0),
        PRIMARY KEY (lease_id, block_index)
    );
    CREATE TABLE frames (
        lease_id   INTEGER NOT NULL REFERENCES leases(id),
        hour_start INTEGER NOT NULL,
        within_slo INTEGER NOT NULL,
        late       INTEGER NOT NULL,
        PRIMARY KEY (lease_id, hour_start)
    );",
    // 2: indexes for the range queries of /api/v1/costs and live leases
    "CREATE INDEX cost_blocks_charged_at ON cost_blocks(charged_at);
     CREATE INDEX leases_state ON leases(state);
     CREATE INDEX frames_hour ON frames(hour_start);",
    // 3: the model a lease serves (the autoscaler scales per model)
    "ALTER TABLE leases ADD COLUMN model TEXT;",
    // 4: who each lease served, per hour: the showback of /api/v1/costs
    "CREATE TABLE usage (
        lease_id   INTEGER NOT NULL REFERENCES leases(id),
        hour_start INTEGER NOT NULL,
        edge       TEXT    NOT NULL,
        model      TEXT    NOT NULL,
        within_slo INTEGER NOT NULL,
        late       INTEGER NOT NULL,
        busy_us    INTEGER NOT NULL,
        PRIMARY KEY (lease_id, hour_start, edge, model)
    );
    CREATE INDEX usage_hour ON usage(hour_start);",
    // 5: when the gateway last heard from each lease's worker, which bills
    // a worker found gone after a restart to when it was last known to run
    "ALTER TABLE leases ADD COLUMN last_seen_at INTEGER;",
];

/// Why a ledger operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LedgerError {
    /// SQLite failed.
    #[error("ledger {op}: {source}")]
    Sqlite {
        /// What we were doing.
        op: &'static str,
        /// The cause.
        source: rusqlite::Error,
    },
    /// The file was written by a newer tidegate.
    #[error(
        "ledger schema version {found} is newer than this build understands ({known}); upgrade tidegate"
    )]
    NewerSchema {
        /// Version in the file.
        found: i64,
        /// Latest version known here.
        known: i64,
    },
    /// No such lease.
    #[error("{0} is not in the ledger")]
    UnknownLease(LeaseId),
    /// The lifecycle forbids the update.
    #[error("{id}: {source}")]
    Transition {
        /// The lease.
        id: LeaseId,
        /// The refused transition.
        source: TransitionError,
    },
    /// A row that this build cannot interpret.
    #[error("ledger row for {id} is corrupt: {what}")]
    Corrupt {
        /// The lease.
        id: LeaseId,
        /// What is wrong.
        what: String,
    },
}

fn sql(op: &'static str) -> impl FnOnce(rusqlite::Error) -> LedgerError {
    move |source| LedgerError::Sqlite { op, source }
}

/// What is recorded when a lease is requested.
#[derive(Debug, Clone)]
pub struct NewLease<'a> {
    /// Provider name (`process`, `static`).
    pub provider: &'a str,
    /// The model it is leased for, if any.
    pub model: Option<&'a str>,
    /// The catalog type.
    pub instance: &'a InstanceType,
    /// Tier.
    pub tier: Tier,
    /// Catalog currency.
    pub currency: &'a str,
    /// When it was requested.
    pub requested_at: Millis,
    /// Digest of its one-time token.
    pub token: Option<TokenDigest>,
}

/// One lease row, as served by `/api/v1/leases`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LeaseRecord {
    /// Id.
    pub id: LeaseId,
    /// Provider name.
    pub provider: String,
    /// The model it serves.
    pub model: Option<String>,
    /// Instance type.
    pub instance_type: String,
    /// Tier.
    pub tier: Tier,
    /// Price per hour.
    pub price_per_hour: Money,
    /// Currency.
    pub currency: String,
    /// Billing granularity.
    pub granularity: Granularity,
    /// Lifecycle state.
    pub state: LeaseState,
    /// Requested at (ms since epoch).
    pub requested_at: Millis,
    /// Billing started at (provider accepted).
    pub billing_start: Option<Millis>,
    /// Worker ready at.
    pub ready_at: Option<Millis>,
    /// Ended at.
    pub ended_at: Option<Millis>,
    /// When the gateway last heard from its worker (connected at a tick;
    /// written at most every few seconds).
    pub last_seen_at: Option<Millis>,
    /// Worker process id (process provider), for adoption.
    pub pid: Option<u32>,
    /// Provider-specific data (JSON), for adoption.
    pub provider_data: Option<String>,
    /// Cost charged so far.
    pub cost: Money,
    /// Frames served within the SLO.
    pub frames_within_slo: u64,
    /// Frames served late.
    pub frames_late: u64,
    /// Whether its one-time token has been used.
    #[serde(skip)]
    pub token_claimed: bool,
    /// Digest of its one-time token.
    #[serde(skip)]
    pub token: Option<TokenDigest>,
}

impl LeaseRecord {
    /// Until when the lease is paid at `now` (None before billing starts).
    pub fn paid_until(&self, now: Millis) -> Option<Millis> {
        self.billing_start
            .map(|s| billing::paid_until(s, now, self.granularity))
    }

    /// The autoscaler's view of this lease (for its `Observation`).
    pub fn view(&self) -> crate::autoscale::LeaseView {
        crate::autoscale::LeaseView {
            id: self.id,
            model: self.model.clone().unwrap_or_default(),
            instance_type: self.instance_type.clone(),
            tier: self.tier,
            state: self.state,
            billing_start: self.billing_start,
            granularity: self.granularity,
            price_per_hour: self.price_per_hour,
        }
    }
}

/// The answer to `/api/v1/costs?from=&to=`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CostReport {
    /// Range start (inclusive, ms since epoch).
    pub from: Millis,
    /// Range end (exclusive).
    pub to: Millis,
    /// Currency of every amount.
    pub currency: Option<String>,
    /// Total charged in the range.
    pub total: Money,
    /// By tier.
    pub by_tier: BTreeMap<Tier, Money>,
    /// By instance type.
    pub by_type: BTreeMap<String, Money>,
    /// Frames served within the SLO in hours starting in the range.
    pub frames_within_slo: u64,
    /// Frames served late in those hours.
    pub frames_late: u64,
    /// Cost per 1000 frames served within the SLO (None without frames).
    pub cost_per_1k_within_slo: Option<f64>,
    /// The cost split among the edges each lease served, by the worker time
    /// their frames took in hours starting in the range ([`showback`]).
    pub by_edge: BTreeMap<String, Share>,
    /// The same split among models.
    pub by_model: BTreeMap<String, Share>,
    /// Cost of leases that served no frame in the range (in neither split).
    pub idle: Money,
}

/// The SQLite ledger.
#[derive(Debug)]
pub struct Ledger {
    conn: Connection,
}

const LEASE_COLUMNS: &str = "id, provider, instance_type, tier, price_micro_per_hour, currency,
    billing_unit, billing_minimum_secs, state, end_reason, requested_at, billing_start,
    ready_at, ended_at, token_sha256, token_claimed, pid, provider_data, model, last_seen_at";

impl Ledger {
    /// Opens (creating if needed) the ledger file, in WAL mode, and applies
    /// pending migrations.
    pub fn open(path: &Path) -> Result<Ledger, LedgerError> {
        let conn = Connection::open(path).map_err(sql("open"))?;
        conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get::<_, String>(0))
            .map_err(sql("set WAL"))?;
        Ledger::init(conn)
    }

    /// An in-memory ledger (tests, simulation).
    pub fn open_in_memory() -> Result<Ledger, LedgerError> {
        Ledger::init(Connection::open_in_memory().map_err(sql("open"))?)
    }

    fn init(mut conn: Connection) -> Result<Ledger, LedgerError> {
        conn.execute_batch(
            "PRAGMA foreign_keys=ON; PRAGMA synchronous=NORMAL; PRAGMA busy_timeout=5000;",
        )
        .map_err(sql("set pragmas"))?;
        let found: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(sql("read schema version"))?;
        let known = MIGRATIONS.len() as i64;
        if found > known {
            return Err(LedgerError::NewerSchema { found, known });
        }
        for (i, m) in MIGRATIONS.iter().enumerate().skip(found as usize) {
            let tx = conn.transaction().map_err(sql("begin migration"))?;
            tx.execute_batch(m).map_err(sql("migrate"))?;
            tx.execute_batch(&format!("PRAGMA user_version = {}", i + 1))
                .map_err(sql("set schema version"))?;
            tx.commit().map_err(sql("commit migration"))?;
            tracing::info!(version = i + 1, "ledger schema migrated");
        }
        Ok(Ledger { conn })
    }

    /// The schema version (number of migrations applied).
    pub fn schema_version(&self) -> Result<i64, LedgerError> {
        self.conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(sql("read schema version"))
    }

    /// The journal mode (`wal` for a file ledger).
    pub fn journal_mode(&self) -> Result<String, LedgerError> {
        self.conn
            .query_row("PRAGMA journal_mode", [], |r| r.get(0))
            .map_err(sql("read journal mode"))
    }

    /// Records a new lease in state `requested`.
    pub fn insert_requested(&mut self, l: &NewLease<'_>) -> Result<LeaseId, LedgerError> {
        let g = l.instance.granularity;
        self.conn
            .execute(
                "INSERT INTO leases (provider, instance_type, tier, price_micro_per_hour,
                   currency, billing_unit, billing_minimum_secs, state, requested_at,
                   token_sha256, model)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, 'requested', ?8, ?9, ?10)",
                params![
                    l.provider,
                    l.instance.name,
                    l.tier.as_str(),
                    l.instance.price_per_hour.get(l.tier).0,
                    l.currency,
                    g.unit(),
                    g.minimum_secs(),
                    l.requested_at as i64,
                    l.token.map(|d| d.0.to_vec()),
                    l.model,
                ],
            )
            .map_err(sql("insert lease"))?;
        Ok(LeaseId(self.conn.last_insert_rowid() as u64))
    }

    fn state_of(&self, id: LeaseId) -> Result<LeaseState, LedgerError> {
        let (label, reason): (String, Option<String>) = self
            .conn
            .query_row(
                "SELECT state, end_reason FROM leases WHERE id = ?1",
                [id.0 as i64],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()
            .map_err(sql("read lease state"))?
            .ok_or(LedgerError::UnknownLease(id))?;
        LeaseState::from_parts(&label, reason.as_deref()).ok_or_else(|| LedgerError::Corrupt {
            id,
            what: format!("state {label:?} reason {reason:?}"),
        })
    }

    fn check(&self, id: LeaseId, to: LeaseState) -> Result<(), LedgerError> {
        self.state_of(id)?
            .transition(to)
            .map(|_| ())
            .map_err(|source| LedgerError::Transition { id, source })
    }

    /// The provider accepted: billing starts at `billing_start`.
    pub fn mark_starting(
        &mut self,
        id: LeaseId,
        billing_start: Millis,
        pid: Option<u32>,
        provider_data: Option<&str>,
    ) -> Result<(), LedgerError> {
        self.check(id, LeaseState::Starting)?;
        self.conn
            .execute(
                "UPDATE leases SET state = 'starting', billing_start = ?2, pid = ?3,
                   provider_data = ?4 WHERE id = ?1",
                params![id.0 as i64, billing_start as i64, pid, provider_data],
            )
            .map_err(sql("mark starting"))?;
        Ok(())
    }

    /// The worker registered and warmed.
    pub fn mark_ready(&mut self, id: LeaseId, at: Millis) -> Result<(), LedgerError> {
        self.check(id, LeaseState::Ready)?;
        self.conn
            .execute(
                "UPDATE leases SET state = 'ready', ready_at = ?2 WHERE id = ?1",
                params![id.0 as i64, at as i64],
            )
            .map_err(sql("mark ready"))?;
        Ok(())
    }

    /// No new frames go to it.
    pub fn mark_draining(&mut self, id: LeaseId) -> Result<(), LedgerError> {
        self.check(id, LeaseState::Draining)?;
        self.conn
            .execute(
                "UPDATE leases SET state = 'draining' WHERE id = ?1",
                [id.0 as i64],
            )
            .map_err(sql("mark draining"))?;
        Ok(())
    }

    /// Records that the workers of `ids` were heard from at `at`, in one
    /// transaction; ended leases and unknown ids are skipped.
    pub fn mark_seen(&mut self, ids: &[LeaseId], at: Millis) -> Result<(), LedgerError> {
        let tx = self.conn.transaction().map_err(sql("begin seen"))?;
        {
            let mut st = tx
                .prepare_cached(
                    "UPDATE leases SET last_seen_at = MAX(?2, COALESCE(last_seen_at, ?2))
                     WHERE id = ?1 AND state != 'ended'",
                )
                .map_err(sql("prepare seen"))?;
            for id in ids {
                st.execute(params![id.0 as i64, at as i64])
                    .map_err(sql("mark seen"))?;
            }
        }
        tx.commit().map_err(sql("commit seen"))
    }

    /// Records that the token was used (or re-armed after adoption).
    pub fn set_token_claimed(&mut self, id: LeaseId, claimed: bool) -> Result<(), LedgerError> {
        let n = self
            .conn
            .execute(
                "UPDATE leases SET token_claimed = ?2 WHERE id = ?1",
                params![id.0 as i64, claimed],
            )
            .map_err(sql("set token claimed"))?;
        if n == 0 {
            return Err(LedgerError::UnknownLease(id));
        }
        Ok(())
    }

    /// The lease ended at `at`; its final blocks are charged at once.
    ///
    /// The end recorded is never before the billing start, nor before the
    /// last block already charged ([`billing::earliest_end_keeping`]): a
    /// lease ended at a time that lags (a gone worker billed to when it was
    /// last seen, after a tick had charged a later block) keeps what was
    /// charged, and its record recomputes to the same cost.
    pub fn mark_ended(
        &mut self,
        id: LeaseId,
        at: Millis,
        reason: EndReason,
    ) -> Result<Money, LedgerError> {
        self.check(id, LeaseState::Ended(reason))?;
        let tx = self.conn.transaction().map_err(sql("begin end"))?;
        let billing_start = read_lease(&tx, id)?.billing_start;
        let kept = last_block(&tx, id)?.map_or(0, |b| billing::earliest_end_keeping(&b));
        let end = at.max(billing_start.unwrap_or(at)).max(kept);
        tx.execute(
            "UPDATE leases SET state = 'ended', end_reason = ?2, ended_at = ?3 WHERE id = ?1",
            params![id.0 as i64, reason.as_str(), end as i64],
        )
        .map_err(sql("mark ended"))?;
        let rec = read_lease(&tx, id)?;
        // charged up to its end, which is never before its billing start:
        // a lease ended before (by this clock) its billing start still owes
        // its first block, and accrue() skips it once it has ended
        let added = accrue_lease(&tx, &rec, end)?;
        tx.commit().map_err(sql("commit end"))?;
        Ok(added)
    }

    /// Charges every block due by `now` on every lease; returns what was
    /// newly charged. Idempotent.
    pub fn accrue(&mut self, now: Millis) -> Result<Money, LedgerError> {
        let tx = self.conn.transaction().map_err(sql("begin accrue"))?;
        let recs = query_leases(&tx, "WHERE billing_start IS NOT NULL AND state != 'ended'")?;
        let mut added = Money::ZERO;
        for rec in &recs {
            added += accrue_lease(&tx, rec, now)?;
        }
        tx.commit().map_err(sql("commit accrue"))?;
        Ok(added)
    }

    /// Adds frames served by `id` in the hour containing `at`.
    pub fn record_frames(
        &mut self,
        id: LeaseId,
        at: Millis,
        within_slo: u64,
        late: u64,
    ) -> Result<(), LedgerError> {
        let hour = at - at % HOUR_MS;
        self.conn
            .execute(
                "INSERT INTO frames (lease_id, hour_start, within_slo, late) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (lease_id, hour_start) DO UPDATE SET
                   within_slo = within_slo + excluded.within_slo, late = late + excluded.late",
                params![id.0 as i64, hour as i64, within_slo as i64, late as i64],
            )
            .map_err(|source| write_error(id, "record frames", source))?;
        Ok(())
    }

    /// Adds what lease `id` did for edge `edge` on model `model` in the hour
    /// containing `at` (the showback of [`Ledger::costs`]).
    pub fn record_usage(
        &mut self,
        id: LeaseId,
        at: Millis,
        edge: &str,
        model: &str,
        u: Usage,
    ) -> Result<(), LedgerError> {
        let hour = at - at % HOUR_MS;
        self.conn
            .execute(
                "INSERT INTO usage (lease_id, hour_start, edge, model, within_slo, late, busy_us)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
                 ON CONFLICT (lease_id, hour_start, edge, model) DO UPDATE SET
                   within_slo = within_slo + excluded.within_slo, late = late + excluded.late,
                   busy_us = busy_us + excluded.busy_us",
                params![
                    id.0 as i64,
                    hour as i64,
                    edge,
                    model,
                    u.within_slo as i64,
                    u.late as i64,
                    u.busy_us as i64
                ],
            )
            .map_err(|source| write_error(id, "record usage", source))?;
        Ok(())
    }

    /// One lease.
    pub fn lease(&self, id: LeaseId) -> Result<Option<LeaseRecord>, LedgerError> {
        match read_lease(&self.conn, id) {
            Ok(r) => Ok(Some(r)),
            Err(LedgerError::UnknownLease(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Every lease, newest first, at most `limit` (`/api/v1/leases`).
    pub fn leases(&self, live_only: bool, limit: u32) -> Result<Vec<LeaseRecord>, LedgerError> {
        let filter = if live_only {
            format!("WHERE state != 'ended' ORDER BY id DESC LIMIT {limit}")
        } else {
            format!("ORDER BY id DESC LIMIT {limit}")
        };
        query_leases(&self.conn, &filter)
    }

    /// Leases not yet ended, oldest first (what a restarted gateway adopts).
    pub fn live_leases(&self) -> Result<Vec<LeaseRecord>, LedgerError> {
        query_leases(&self.conn, "WHERE state != 'ended' ORDER BY id")
    }

    /// Rebuilds the in-memory lease table from the live leases.
    pub fn load_table(&self) -> Result<LeaseTable, LedgerError> {
        let mut t = LeaseTable::new();
        for r in self.live_leases()? {
            let token = r.token.ok_or_else(|| LedgerError::Corrupt {
                id: r.id,
                what: "live lease without a token digest".into(),
            })?;
            t.insert(LeaseEntry {
                id: r.id,
                instance_type: r.instance_type,
                tier: r.tier,
                state: r.state,
                token,
                claimed: r.token_claimed,
            })
            .map_err(|e| LedgerError::Corrupt {
                id: r.id,
                what: e.to_string(),
            })?;
        }
        Ok(t)
    }

    /// Cost charged (accrued) in `[from, to)`.
    pub fn accrued_cost(&self, from: Millis, to: Millis) -> Result<Money, LedgerError> {
        let v: i64 = self
            .conn
            .query_row(
                "SELECT COALESCE(SUM(amount_micro), 0) FROM cost_blocks
                 WHERE charged_at >= ?1 AND charged_at < ?2",
                params![from as i64, to as i64],
                |r| r.get(0),
            )
            .map_err(sql("sum cost"))?;
        Ok(Money(v))
    }

    /// Cost in `[from, to)` recomputed from the lease rows alone, as of
    /// `now`. Equals [`Ledger::accrued_cost`] after [`Ledger::accrue`]`(now)`.
    pub fn recompute_cost(
        &self,
        from: Millis,
        to: Millis,
        now: Millis,
    ) -> Result<Money, LedgerError> {
        let recs = query_leases(&self.conn, "WHERE billing_start IS NOT NULL")?;
        Ok(recs
            .iter()
            .map(|r| {
                billing::cost_in_range(
                    r.billing_start.unwrap_or(0),
                    r.ended_at,
                    now,
                    r.granularity,
                    r.price_per_hour,
                    from,
                    to,
                )
            })
            .sum())
    }

    /// Total charged per tier since the beginning (`tidegate_cost_total{tier}`).
    pub fn cost_total_by_tier(&self) -> Result<BTreeMap<Tier, Money>, LedgerError> {
        Ok(self.cost_totals(0, Millis::MAX / 2)?.by_tier)
    }

    /// The cost report for `[from, to)` (`/api/v1/costs`), with the split
    /// by edge and by model.
    pub fn costs(&self, from: Millis, to: Millis) -> Result<CostReport, LedgerError> {
        let mut report = self.cost_totals(from, to)?;
        let (lease_costs, usage) = usage_in(&self.conn, from, to)?;
        let by = |key: fn(&(LeaseId, String, String, Usage)) -> &String| {
            let rows: Vec<(LeaseId, String, Usage)> =
                usage.iter().map(|r| (r.0, key(r).clone(), r.3)).collect();
            showback::attribute(&lease_costs, &rows)
        };
        let (edges, models) = (by(|r| &r.1), by(|r| &r.2));
        report.by_edge = edges.shares;
        report.by_model = models.shares;
        report.idle = edges.idle;
        Ok(report)
    }

    /// [`Ledger::costs`] without the split by edge and model (empty, idle
    /// zero): cheaper, for the metrics each tick.
    pub fn cost_totals(&self, from: Millis, to: Millis) -> Result<CostReport, LedgerError> {
        let mut by_tier = BTreeMap::new();
        let mut by_type = BTreeMap::new();
        let mut total = Money::ZERO;
        {
            let mut st = self
                .conn
                .prepare(
                    "SELECT l.tier, l.instance_type, SUM(b.amount_micro)
                     FROM cost_blocks b JOIN leases l ON l.id = b.lease_id
                     WHERE b.charged_at >= ?1 AND b.charged_at < ?2
                     GROUP BY l.tier, l.instance_type",
                )
                .map_err(sql("prepare costs"))?;
            let rows = st
                .query_map(params![from as i64, to as i64], |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, String>(1)?,
                        r.get::<_, i64>(2)?,
                    ))
                })
                .map_err(sql("query costs"))?;
            for row in rows {
                let (tier, ty, amount) = row.map_err(sql("read costs"))?;
                let tier = Tier::parse(&tier).ok_or_else(|| LedgerError::Corrupt {
                    id: LeaseId(0),
                    what: format!("tier {tier:?}"),
                })?;
                *by_tier.entry(tier).or_insert(Money::ZERO) += Money(amount);
                *by_type.entry(ty).or_insert(Money::ZERO) += Money(amount);
                total += Money(amount);
            }
        }
        let (within, late): (i64, i64) = self
            .conn
            .query_row(
                "SELECT COALESCE(SUM(within_slo), 0), COALESCE(SUM(late), 0) FROM frames
                 WHERE hour_start >= ?1 AND hour_start < ?2",
                params![from as i64, to as i64],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .map_err(sql("sum frames"))?;
        let currency: Option<String> = self
            .conn
            .query_row("SELECT currency FROM leases LIMIT 1", [], |r| r.get(0))
            .optional()
            .map_err(sql("read currency"))?;
        Ok(CostReport {
            from,
            to,
            currency,
            total,
            by_tier,
            by_type,
            frames_within_slo: within as u64,
            frames_late: late as u64,
            cost_per_1k_within_slo: crate::metrics::cost_per_1k(total, within as u64),
            ..CostReport::default()
        })
    }
}

/// A write about lease `id` that failed: a foreign-key violation means the
/// lease is not in the ledger.
fn write_error(id: LeaseId, op: &'static str, source: rusqlite::Error) -> LedgerError {
    match source {
        rusqlite::Error::SqliteFailure(e, _)
            if e.code == rusqlite::ErrorCode::ConstraintViolation =>
        {
            LedgerError::UnknownLease(id)
        }
        source => LedgerError::Sqlite { op, source },
    }
}

/// Each lease's cost charged in `[from, to)`, and its usage rows (per edge
/// and model) in hours starting there.
#[allow(clippy::type_complexity)]
fn usage_in(
    conn: &Connection,
    from: Millis,
    to: Millis,
) -> Result<(Vec<(LeaseId, Money)>, Vec<(LeaseId, String, String, Usage)>), LedgerError> {
    let range = params![from as i64, to as i64];
    let mut st = conn
        .prepare(
            "SELECT lease_id, SUM(amount_micro) FROM cost_blocks
             WHERE charged_at >= ?1 AND charged_at < ?2 GROUP BY lease_id",
        )
        .map_err(sql("prepare lease costs"))?;
    let costs = st
        .query_map(range, |r| {
            Ok((LeaseId(r.get::<_, i64>(0)? as u64), Money(r.get(1)?)))
        })
        .map_err(sql("query lease costs"))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(sql("read lease costs"))?;
    let mut st = conn
        .prepare(
            "SELECT lease_id, edge, model, SUM(within_slo), SUM(late), SUM(busy_us) FROM usage
             WHERE hour_start >= ?1 AND hour_start < ?2 GROUP BY lease_id, edge, model",
        )
        .map_err(sql("prepare usage"))?;
    let rows = st
        .query_map(range, |r| {
            Ok((
                LeaseId(r.get::<_, i64>(0)? as u64),
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                Usage {
                    within_slo: r.get::<_, i64>(3)? as u64,
                    late: r.get::<_, i64>(4)? as u64,
                    busy_us: r.get::<_, i64>(5)? as u64,
                },
            ))
        })
        .map_err(sql("query usage"))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(sql("read usage"))?;
    Ok((costs, rows))
}

fn read_lease(conn: &Connection, id: LeaseId) -> Result<LeaseRecord, LedgerError> {
    let mut v = query_leases(conn, &format!("WHERE id = {}", id.0))?;
    v.pop().ok_or(LedgerError::UnknownLease(id))
}

fn query_leases(conn: &Connection, tail: &str) -> Result<Vec<LeaseRecord>, LedgerError> {
    let q = format!(
        "SELECT {LEASE_COLUMNS},
           (SELECT COALESCE(SUM(amount_micro), 0) FROM cost_blocks b WHERE b.lease_id = leases.id),
           (SELECT COALESCE(SUM(within_slo), 0) FROM frames f WHERE f.lease_id = leases.id),
           (SELECT COALESCE(SUM(late), 0) FROM frames f WHERE f.lease_id = leases.id)
         FROM leases {tail}"
    );
    let mut st = conn.prepare(&q).map_err(sql("prepare lease query"))?;
    #[allow(clippy::type_complexity)]
    let rows = st
        .query_map([], |r| {
            Ok((
                (
                    r.get::<_, i64>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                    r.get::<_, String>(3)?,
                    r.get::<_, i64>(4)?,
                    r.get::<_, String>(5)?,
                    r.get::<_, String>(6)?,
                    r.get::<_, u32>(7)?,
                    r.get::<_, String>(8)?,
                    r.get::<_, Option<String>>(9)?,
                ),
                (
                    r.get::<_, i64>(10)?,
                    r.get::<_, Option<i64>>(11)?,
                    r.get::<_, Option<i64>>(12)?,
                    r.get::<_, Option<i64>>(13)?,
                    r.get::<_, Option<Vec<u8>>>(14)?,
                    r.get::<_, bool>(15)?,
                    r.get::<_, Option<u32>>(16)?,
                    r.get::<_, Option<String>>(17)?,
                    r.get::<_, Option<String>>(18)?,
                    r.get::<_, Option<i64>>(19)?,
                    r.get::<_, i64>(20)?,
                    r.get::<_, i64>(21)?,
                    r.get::<_, i64>(22)?,
                ),
            ))
        })
        .map_err(sql("query leases"))?;
    let mut out = Vec::new();
    for row in rows {
        let (
            (id, provider, instance_type, tier, price, currency, unit, min_secs, state, reason),
            (
                requested,
                start,
                ready,
                ended,
                token,
                claimed,
                pid,
                data,
                model,
                seen,
                cost,
                within,
                late,
            ),
        ) = row.map_err(sql("read lease"))?;
        let id = LeaseId(id as u64);
        let corrupt = |what: String| LedgerError::Corrupt { id, what };
        let tier = Tier::parse(&tier).ok_or_else(|| corrupt(format!("tier {tier:?}")))?;
        let granularity = Granularity::from_parts(&unit, min_secs)
            .ok_or_else(|| corrupt(format!("billing unit {unit:?}")))?;
        let state = LeaseState::from_parts(&state, reason.as_deref())
            .ok_or_else(|| corrupt(format!("state {state:?} reason {reason:?}")))?;
        let token = match token {
            Some(b) => {
                Some(TokenDigest(b.try_into().map_err(|_| {
                    corrupt("token digest is not 32 bytes".into())
                })?))
            }
            None => None,
        };
        out.push(LeaseRecord {
            id,
            provider,
            model,
            instance_type,
            tier,
            price_per_hour: Money(price),
            currency,
            granularity,
            state,
            requested_at: requested as u64,
            billing_start: start.map(|v| v as u64),
            ready_at: ready.map(|v| v as u64),
            ended_at: ended.map(|v| v as u64),
            last_seen_at: seen.map(|v| v as u64),
            pid,
            provider_data: data,
            cost: Money(cost),
            frames_within_slo: within as u64,
            frames_late: late as u64,
            token_claimed: claimed,
            token,
        });
    }
    Ok(out)
}

/// The last block charged to `id`, if any.
fn last_block(conn: &Connection, id: LeaseId) -> Result<Option<billing::Block>, LedgerError> {
    conn.prepare_cached(
        "SELECT block_index, block_start, block_end, charged_at, amount_micro
         FROM cost_blocks WHERE lease_id = ?1 ORDER BY block_index DESC LIMIT 1",
    )
    .and_then(|mut q| {
        q.query_row([id.0 as i64], |r| {
            Ok(billing::Block {
                index: r.get(0)?,
                start: r.get::<_, i64>(1)? as Millis,
                end: r.get::<_, i64>(2)? as Millis,
                charged_at: r.get::<_, i64>(3)? as Millis,
                amount: Money(r.get(4)?),
            })
        })
        .optional()
    })
    .map_err(sql("read last block"))
}

fn accrue_lease(conn: &Connection, rec: &LeaseRecord, now: Millis) -> Result<Money, LedgerError> {
    let Some(start) = rec.billing_start else {
        return Ok(Money::ZERO);
    };
    // blocks are charged in index order, so only those after the last
    // recorded one can be new (INSERT OR IGNORE keeps it idempotent anyway)
    let last: Option<i64> = conn
        .prepare_cached("SELECT MAX(block_index) FROM cost_blocks WHERE lease_id = ?1")
        .and_then(|mut q| q.query_row([rec.id.0 as i64], |r| r.get(0)))
        .map_err(sql("read last block"))?;
    let mut st = conn
        .prepare_cached(
            "INSERT OR IGNORE INTO cost_blocks
               (lease_id, block_index, block_start, block_end, charged_at, amount_micro)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        )
        .map_err(sql("prepare accrue"))?;
    let mut added = Money::ZERO;
    let due = billing::blocks(
        start,
        rec.ended_at,
        now,
        rec.granularity,
        rec.price_per_hour,
    );
    for b in due
        .into_iter()
        .filter(|b| last.is_none_or(|l| i64::from(b.index) > l))
    {
        let n = st
            .execute(params![
                rec.id.0 as i64,
                b.index,
                b.start as i64,
                b.end as i64,
                b.charged_at as i64,
                b.amount.0
            ])
            .map_err(sql("insert block"))?;
        if n == 1 {
            added += b.amount;
        }
    }
    Ok(added)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn old_schema_is_migrated_in_place_and_rows_survive() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v2.sqlite");
        {
            // a ledger written by a build that knew two migrations
            let c = Connection::open(&path).unwrap();
            c.execute_batch(MIGRATIONS[0]).unwrap();
            c.execute_batch(MIGRATIONS[1]).unwrap();
            c.execute_batch("PRAGMA user_version = 2").unwrap();
            c.execute(
                "INSERT INTO leases (provider, instance_type, tier, price_micro_per_hour, currency,
                   billing_unit, billing_minimum_secs, state, requested_at, billing_start)
                 VALUES ('process', 'a100', 'spot', 7700000, 'CNY', 'hour', 3600, 'starting', 5, 5)",
                [],
            )
            .unwrap();
        }
        let mut l = Ledger::open(&path).unwrap();
        assert_eq!(l.schema_version().unwrap(), MIGRATIONS.len() as i64);
        let r = l.lease(LeaseId(1)).unwrap().unwrap();
        assert_eq!(r.model, None);
        assert_eq!(r.state, LeaseState::Starting);
        assert_eq!(l.accrue(10).unwrap(), Money(7_700_000));
        drop(l);
        // and once more: nothing to migrate, nothing lost
        let l = Ledger::open(&path).unwrap();
        assert_eq!(l.lease(LeaseId(1)).unwrap().unwrap().cost, Money(7_700_000));
    }

    #[test]
    fn a_lease_ended_before_its_billing_start_is_charged_its_first_block() {
        let catalog = crate::catalog::Catalog::default_catalog();
        let mut l = Ledger::open_in_memory().unwrap();
        let id = l
            .insert_requested(&NewLease {
                provider: "process",
                model: Some("m"),
                instance: catalog.get("a100").unwrap(),
                tier: Tier::Spot,
                currency: &catalog.currency,
                requested_at: 1_000,
                token: None,
            })
            .unwrap();
        // the provider's billing start is ahead of the clock that ends it
        l.mark_starting(id, 10_000, None, None).unwrap();
        let block = Money(7_700_000);
        assert_eq!(l.mark_ended(id, 5_000, EndReason::Lost).unwrap(), block);
        let r = l.lease(id).unwrap().unwrap();
        assert_eq!(r.ended_at, Some(10_000));
        assert_eq!(r.cost, block);
        // nothing more later, and the ledger agrees with its recomputation
        assert_eq!(l.accrue(HOUR_MS * 3).unwrap(), Money::ZERO);
        assert_eq!(l.accrued_cost(0, HOUR_MS * 3).unwrap(), block);
        assert_eq!(
            l.recompute_cost(0, HOUR_MS * 3, HOUR_MS * 3).unwrap(),
            block
        );
    }

    #[test]
    fn a_lease_ended_before_a_block_already_charged_keeps_it_and_agrees_with_its_recomputation() {
        let catalog = crate::catalog::Catalog::default_catalog();
        let mut l = Ledger::open_in_memory().unwrap();
        // an hourly A100 (7.70 per block) and a per-second CPU (1.40 per
        // hour, 60 s minimum, then minutes in arrears)
        let mut lease = |ty: &str| {
            let id = l
                .insert_requested(&NewLease {
                    provider: "process",
                    model: Some("m"),
                    instance: catalog.get(ty).unwrap(),
                    tier: Tier::Spot,
                    currency: &catalog.currency,
                    requested_at: 0,
                    token: None,
                })
                .unwrap();
            l.mark_starting(id, 0, None, None).unwrap();
            id
        };
        let (hourly, secondly) = (lease("a100"), lease("cpu-32"));
        // both workers last seen at 59:55; a tick past the hour charges the
        // A100's second block and the CPU's minutes up to 60:00; then the
        // gateway crashes, and adoption finds both workers gone and bills
        // them to when they were last seen
        let seen = HOUR_MS - 5_000;
        l.mark_seen(&[hourly, secondly], seen).unwrap();
        l.accrue(HOUR_MS + 2_000).unwrap();
        let charged = l.accrued_cost(0, HOUR_MS * 3).unwrap();
        assert_eq!(
            l.mark_ended(hourly, seen, EndReason::Lost).unwrap(),
            Money::ZERO
        );
        assert_eq!(
            l.mark_ended(secondly, seen, EndReason::Lost).unwrap(),
            Money::ZERO
        );
        let now = HOUR_MS * 3;
        assert_eq!(l.accrue(now).unwrap(), Money::ZERO);
        assert_eq!(l.accrued_cost(0, now).unwrap(), charged);
        assert_eq!(l.recompute_cost(0, now, now).unwrap(), charged);
        assert_eq!(l.lease(hourly).unwrap().unwrap().cost, Money(2 * 7_700_000));
        // ended just past the start of the A100's second block, and at the
        // end of the CPU's last minute charged
        let ended = |id| l.lease(id).unwrap().unwrap().ended_at;
        assert_eq!(ended(hourly), Some(HOUR_MS + 1));
        assert_eq!(ended(secondly), Some(HOUR_MS));
    }
}
