//! `tidegate-gateway check-config`: what `run` would need, checked without
//! running: every file the configuration names is read as `run` reads it
//! (the TLS certificate and key, the catalog, the ledger, the provider's
//! tools), each listen address is bound and let go, and a port in use names
//! the flag that changes it. The result is a short summary, one line a
//! setting, and one line a check.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use crate::config::{Config, LeasingConfig, ProviderKind};

/// One check: what was checked, and what was found (or what is wrong and
/// what to do).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// What was checked.
    pub what: String,
    /// What was found, or the problem.
    pub outcome: Result<String, String>,
}

impl Check {
    fn new(what: impl Into<String>, outcome: Result<String, String>) -> Check {
        Check {
            what: what.into(),
            outcome,
        }
    }
}

/// The transport of a listen address, with the flag and the environment
/// variable that change it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listener {
    /// `quic.listen` (UDP).
    Quic,
    /// `http.listen` (TCP).
    Http,
}

impl Listener {
    fn key(self) -> &'static str {
        match self {
            Listener::Quic => "quic.listen",
            Listener::Http => "http.listen",
        }
    }

    fn flag(self) -> &'static str {
        match self {
            Listener::Quic => "--quic-listen ADDR (or TIDEGATE_QUIC_LISTEN)",
            Listener::Http => "--http-listen ADDR (or TIDEGATE_HTTP_LISTEN)",
        }
    }

    fn transport(self) -> &'static str {
        match self {
            Listener::Quic => "UDP",
            Listener::Http => "TCP",
        }
    }
}

/// Why binding `addr` for `listener` failed, saying which setting and flag
/// change it when the port is taken.
pub fn bind_error(listener: Listener, addr: SocketAddr, e: &std::io::Error) -> String {
    let (key, flag, transport) = (listener.key(), listener.flag(), listener.transport());
    match e.kind() {
        std::io::ErrorKind::AddrInUse => format!(
            "{transport} {addr} ({key}) is in use by another process: stop it, or listen elsewhere with {flag} or `{key}` in the config"
        ),
        std::io::ErrorKind::AddrNotAvailable => format!(
            "{transport} {addr} ({key}) is not an address of this machine: use one it has (0.0.0.0 for all) with {flag} or `{key}`"
        ),
        std::io::ErrorKind::PermissionDenied => format!(
            "{transport} {addr} ({key}): permission denied (ports below 1024 need privileges): use a higher port with {flag} or `{key}`"
        ),
        _ => format!("{transport} {addr} ({key}): {e}"),
    }
}

/// Binds `addr` as `listener` would, and lets it go.
fn try_bind(listener: Listener, addr: SocketAddr) -> Result<String, String> {
    let bound = match listener {
        Listener::Quic => std::net::UdpSocket::bind(addr).and_then(|s| s.local_addr()),
        Listener::Http => std::net::TcpListener::bind(addr).and_then(|s| s.local_addr()),
    };
    bound
        .map(|a| format!("{} {a} is free", listener.transport()))
        .map_err(|e| bind_error(listener, addr, &e))
}

/// The certificate and key, loaded into the TLS configuration `run` uses.
fn tls(cfg: &Config) -> Result<String, String> {
    let q = &cfg.quic;
    tidegate_protocol::quic::login_gated_server_config(&q.cert, &q.key, q.congestion)
        .map(|_| format!("{} and {} load", q.cert.display(), q.key.display()))
        .map_err(|e| format!("{e:#} (quic.cert, quic.key)"))
}

/// The first bytes of every SQLite 3 database file.
const SQLITE_MAGIC: &[u8] = b"SQLite format 3\0";

/// The ledger: an SQLite file, or a folder it can be created in.
fn ledger(path: &Path) -> Result<String, String> {
    if path.exists() {
        let mut head = Vec::with_capacity(SQLITE_MAGIC.len());
        let read = std::fs::File::open(path)
            .and_then(|f| std::io::Read::read_to_end(&mut std::io::Read::take(f, 16), &mut head));
        return match read {
            // SQLite takes an empty file as a new database
            Ok(0) => Ok(format!("{} is empty: a new ledger", path.display())),
            Ok(_) if head == SQLITE_MAGIC => Ok(format!("{} is an SQLite file", path.display())),
            Ok(_) => Err(format!(
                "{} (leasing.ledger) is not an SQLite database: point the ledger at a new file or at the gateway's ledger",
                path.display()
            )),
            Err(e) => Err(format!(
                "{} (leasing.ledger) cannot be read: {e}",
                path.display()
            )),
        };
    }
    let folder = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    match std::fs::metadata(&folder) {
        Ok(m) if m.is_dir() && !m.permissions().readonly() => Ok(format!(
            "{} will be created in {}",
            path.display(),
            folder.display()
        )),
        Ok(m) if m.is_dir() => Err(format!(
            "{} (leasing.ledger) cannot be created: {} is read-only",
            path.display(),
            folder.display()
        )),
        Ok(_) => Err(format!(
            "{} (leasing.ledger) cannot be created: {} is not a folder",
            path.display(),
            folder.display()
        )),
        Err(e) => Err(format!(
            "{} (leasing.ledger) cannot be created: its folder {}: {e}",
            path.display(),
            folder.display()
        )),
    }
}

/// A program as a provider would start it: a path that exists, or a name
/// found on `PATH`.
fn program(name: &str, setting: &str) -> Result<String, String> {
    let direct = Path::new(name);
    if name.contains('/') {
        return if direct.is_file() {
            Ok(format!("{name} exists"))
        } else {
            Err(format!("{name} ({setting}) does not exist"))
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .map(|p| format!("{name} is {}", p.display()))
        .ok_or_else(|| format!("{name} ({setting}) is not on PATH: give its full path"))
}

/// A file a setting names must exist.
fn file(path: &Path, setting: &str) -> Result<String, String> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => Ok(format!("{} exists", path.display())),
        Ok(_) => Err(format!("{} ({setting}) is not a file", path.display())),
        Err(e) => Err(format!("{} ({setting}): {e}", path.display())),
    }
}

/// The leasing section's files and tools.
fn leasing_checks(l: &LeasingConfig, out: &mut Vec<Check>) {
    let catalog = match &l.catalog {
        Some(p) => tidegate_lease::catalog::Catalog::load(p)
            .map(|c| format!("{} ({} instance types)", p.display(), c.instances.len()))
            .map_err(|e| format!("{e} (leasing.catalog)")),
        None => Ok("the built-in catalog".to_string()),
    };
    out.push(Check::new("pricing catalog", catalog));
    out.push(Check::new("ledger", ledger(&l.ledger)));
    match l.provider {
        ProviderKind::Process => {
            if let Some(p) = &l.process {
                out.push(Check::new(
                    "worker command",
                    program(&p.command, "leasing.process.command"),
                ));
            }
        }
        ProviderKind::Slurm => {
            if let Some(s) = &l.slurm {
                for tool in ["sbatch", "squeue", "scancel", "scontrol"] {
                    let found = match &s.bin_dir {
                        Some(d) => file(&d.join(tool), "leasing.slurm.bin_dir"),
                        None => program(tool, "leasing.slurm.bin_dir"),
                    };
                    out.push(Check::new(format!("Slurm's {tool}"), found));
                }
                if let Some(c) = &s.slurm_conf {
                    out.push(Check::new(
                        "slurm.conf",
                        file(c, "leasing.slurm.slurm_conf"),
                    ));
                }
            }
        }
        ProviderKind::Kubernetes => {
            if let Some(k) = l.kubernetes.as_ref().and_then(|k| k.kubeconfig.as_ref()) {
                out.push(Check::new(
                    "kubeconfig",
                    file(k, "leasing.kubernetes.kubeconfig"),
                ));
            }
        }
        ProviderKind::Static => {}
    }
}

/// Every check `run` would fail on, in order.
pub fn check(cfg: &Config) -> Vec<Check> {
    let mut out = vec![
        Check::new("TLS certificate and key", tls(cfg)),
        Check::new(
            "QUIC listen address",
            try_bind(Listener::Quic, cfg.quic.listen),
        ),
        Check::new(
            "HTTP listen address",
            try_bind(Listener::Http, cfg.http.listen),
        ),
    ];
    if let Some(l) = &cfg.leasing {
        leasing_checks(l, &mut out);
    }
    out
}

/// Names, at most `most` of them, then how many more; `none` for none.
fn names<'a>(all: impl ExactSizeIterator<Item = &'a str>, most: usize) -> String {
    let n = all.len();
    if n == 0 {
        return "none".to_string();
    }
    let mut s: Vec<&str> = all.take(most).collect();
    let more = n.saturating_sub(most);
    let more = (more > 0).then(|| format!("{more} more"));
    if let Some(m) = &more {
        s.push(m);
    }
    s.join(", ")
}

/// The settings that matter at a glance, one line each.
pub fn summary(cfg: &Config) -> String {
    let mut s = String::new();
    let q = &cfg.quic;
    let _ = writeln!(
        s,
        "quic     {} (cert {}, congestion {})",
        q.listen,
        q.cert.display(),
        q.congestion
    );
    let admin = if cfg.http.admin_token_sha256.is_some() {
        "admin routes on"
    } else {
        "admin routes off"
    };
    let _ = writeln!(s, "http     {} ({admin})", cfg.http.listen);
    let edges = names(cfg.edges.iter().map(|e| e.name.as_str()), 5);
    let _ = writeln!(s, "edges    {}: {edges}", cfg.edges.len());
    let workers = names(cfg.workers.iter().map(|w| w.name.as_str()), 5);
    let _ = writeln!(s, "workers  {}: {workers}", cfg.workers.len());
    match &cfg.leasing {
        Some(l) => {
            let models = names(l.models.iter().map(|m| m.name.as_str()), 5);
            let _ = writeln!(
                s,
                "leasing  {:?} provider, {} policy, models {models}, ledger {}",
                l.provider,
                l.policy,
                l.ledger.display()
            );
        }
        None => {
            let _ = writeln!(s, "leasing  off (workers come from [[workers]] only)");
        }
    }
    let _ = write!(
        s,
        "queue    {} frames at most, {} per edge",
        cfg.scheduler.max_queued, cfg.scheduler.max_queued_per_edge
    );
    s
}

/// The summary and each check as `check-config` prints them; `Err` with
/// the same text when a check failed.
pub fn report(cfg: &Config) -> Result<String, String> {
    let checks = check(cfg);
    let mut text = summary(cfg);
    text.push('\n');
    for c in &checks {
        let (mark, detail) = match &c.outcome {
            Ok(d) => ("ok  ", d),
            Err(e) => ("FAIL", e),
        };
        let _ = write!(text, "\n{mark} {}: {detail}", c.what);
    }
    let failed = checks.iter().filter(|c| c.outcome.is_err()).count();
    if failed == 0 {
        text.push_str("\nconfig ok");
        Ok(text)
    } else {
        let _ = write!(text, "\n{failed} check(s) failed: `run` would stop");
        Err(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(dir: &Path) -> Config {
        let mut cfg = Config::default_config();
        cfg.quic.listen = "127.0.0.1:0".parse().unwrap();
        cfg.http.listen = "127.0.0.1:0".parse().unwrap();
        let c = crate::certs::generate(dir, &["localhost".to_string()]).unwrap();
        cfg.quic.cert = c.server_cert;
        cfg.quic.key = c.server_key;
        cfg
    }

    #[test]
    fn a_good_config_passes_with_a_short_summary() {
        let dir = tempfile::tempdir().unwrap();
        let text = report(&config(dir.path())).unwrap();
        assert!(text.ends_with("config ok"), "{text}");
        assert!(text.lines().count() < 15, "{text}");
        assert!(text.contains("ok   TLS certificate and key"), "{text}");
    }

    #[test]
    fn a_missing_certificate_fails_naming_the_file_and_the_setting() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = config(dir.path());
        cfg.quic.cert = dir.path().join("nope.pem");
        let text = report(&cfg).unwrap_err();
        assert!(text.contains("FAIL TLS certificate and key"), "{text}");
        assert!(
            text.contains("nope.pem") && text.contains("quic.cert"),
            "{text}"
        );
    }

    #[test]
    fn a_port_in_use_names_the_flag_that_changes_it() {
        let dir = tempfile::tempdir().unwrap();
        let taken_tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let taken_udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut cfg = config(dir.path());
        cfg.http.listen = taken_tcp.local_addr().unwrap();
        cfg.quic.listen = taken_udp.local_addr().unwrap();
        let text = report(&cfg).unwrap_err();
        assert!(
            text.contains("--http-listen") && text.contains("http.listen"),
            "{text}"
        );
        assert!(
            text.contains("--quic-listen") && text.contains("quic.listen"),
            "{text}"
        );
        assert!(text.contains("2 check(s) failed"), "{text}");
    }

    #[test]
    fn a_ledger_that_is_not_sqlite_or_cannot_be_created_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let junk = dir.path().join("ledger.db");
        std::fs::write(&junk, b"not a database at all").unwrap();
        assert!(
            ledger(&junk)
                .unwrap_err()
                .contains("not an SQLite database")
        );
        let nowhere = dir.path().join("no/such/folder/ledger.db");
        assert!(ledger(&nowhere).unwrap_err().contains("leasing.ledger"));
        let fresh = dir.path().join("new.db");
        assert!(ledger(&fresh).unwrap().contains("will be created"));
        let db = rusqlite::Connection::open(&fresh).unwrap();
        db.execute_batch("create table t (x)").unwrap();
        drop(db);
        assert!(ledger(&fresh).unwrap().contains("is an SQLite file"));
    }

    #[test]
    fn a_provider_program_is_found_on_path_or_refused() {
        assert!(program("sh", "x").is_ok());
        let e = program("no-such-tidegate-tool", "leasing.process.command").unwrap_err();
        assert!(
            e.contains("not on PATH") && e.contains("leasing.process.command"),
            "{e}"
        );
        assert!(
            program("/no/such/tool", "s")
                .unwrap_err()
                .contains("does not exist")
        );
    }

    #[test]
    fn long_name_lists_are_cut() {
        let all = ["a", "b", "c", "d"];
        assert_eq!(names(all.iter().copied(), 2), "a, b, 2 more");
        assert_eq!(names(all.iter().copied(), 9), "a, b, c, d");
        assert_eq!(names(std::iter::empty(), 9), "none");
    }
}
