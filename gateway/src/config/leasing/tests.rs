//! `[leasing]` as the whole file sees it: what is accepted, what is refused
//! and with which words, and which paths resolve against the file.

use super::OnStop;
use crate::config::{Config, ConfigError};

fn leasing(extra: &str) -> Result<(), ConfigError> {
    let text = format!("[leasing]\nprovider = \"process\"\nledger = \"l.db\"\n{extra}\n");
    let cfg: Config = toml::from_str(&text).map_err(|e| ConfigError::Invalid(e.to_string()))?;
    cfg.validate()
}

const PROCESS: &str = "[leasing.process]\ncommand = \"tidegate-worker\"\n";
const MODEL: &str =
    "[[leasing.models]]\nname = \"blazeface\"\ninstance_types = [\"cpu-32\"]\nworker_fps = 50\n";

#[test]
fn leasing_is_optional_and_a_full_section_validates() {
    assert!(Config::default_config().leasing.is_none());
    leasing(&format!("policy = \"tidal\"\nspend_cap_per_hour = 20.0\ntick_ms = 500\n{PROCESS}env = {{ A = \"b\" }}\nnotice_period_secs = 1\n{MODEL}")).unwrap();
}

#[test]
fn leasing_errors_name_the_field_and_the_fix() {
    let e = leasing(&format!("policy = \"cheap\"\n{PROCESS}{MODEL}"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("leasing.policy") && e.contains("paid-block-aware"),
        "{e}"
    );
    let e = leasing(MODEL).unwrap_err().to_string();
    assert!(e.contains("[leasing.process]"), "{e}");
    let e = leasing(PROCESS).unwrap_err().to_string();
    assert!(e.contains("[[leasing.models]]"), "{e}");
    let e = leasing(&format!("{PROCESS}{}", MODEL.replace("cpu-32", "tpu")))
        .unwrap_err()
        .to_string();
    assert!(e.contains("'tpu'") && e.contains("h100"), "{e}");
    let e = leasing(&format!("{PROCESS}{}", MODEL.replace("50", "0")))
        .unwrap_err()
        .to_string();
    assert!(e.contains("worker_fps"), "{e}");
    let e = leasing(&format!("spend_cap_per_hour = -1.0\n{PROCESS}{MODEL}"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("spend_cap_per_hour"), "{e}");
    let e = leasing(&format!(
        "catalog = \"/nonexistent/c.toml\"\n{PROCESS}{MODEL}"
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("/nonexistent/c.toml"), "{e}");
    let e = leasing(&format!("{PROCESS}{MODEL}{MODEL}"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("twice"), "{e}");
}

#[test]
fn leasing_values_that_would_overflow_or_panic_are_refused_naming_the_field() {
    for (extra, field) in [
        ("notice_period_secs = 1e20\n", "notice_period_secs"),
        ("notice_period_secs = -1\n", "notice_period_secs"),
        ("notice_period_secs = inf\n", "notice_period_secs"),
        (
            "preempt_spot_after_secs = 1e300\n",
            "preempt_spot_after_secs",
        ),
    ] {
        let e = leasing(&format!("{PROCESS}{extra}{MODEL}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("leasing.process.{field}")), "{e}");
    }
    for (extra, field) in [
        (
            "release_window_secs = 18446744073709551615",
            "release_window_secs",
        ),
        ("release_window_secs = 0", "release_window_secs"),
        (
            "down_window_secs = 18446744073709551615",
            "down_window_secs",
        ),
        ("idle_timeout_secs = 0", "idle_timeout_secs"),
        ("renew_horizon_secs = 0", "renew_horizon_secs"),
        ("hedge_margin = -1.0", "hedge_margin"),
        ("hedge_margin = nan", "hedge_margin"),
        ("spot_fallback_min_share = 1.5", "spot_fallback_min_share"),
        ("spot_fallback_min_share = nan", "spot_fallback_min_share"),
        ("spot_refused_cooloff_secs = 0", "spot_refused_cooloff_secs"),
        (
            "start_timeout_secs = 18446744073709551615",
            "start_timeout_secs",
        ),
        ("rejoin_timeout_secs = 0", "rejoin_timeout_secs"),
        ("spend_cap_per_hour = 1e300", "spend_cap_per_hour"),
    ] {
        let e = leasing(&format!("{extra}\n{PROCESS}{MODEL}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("leasing.{field}")), "{extra}: {e}");
    }
}

#[test]
fn a_release_window_must_fit_a_tick_and_a_release_for_hourly_blocks() {
    let hourly = MODEL.replace("cpu-32", "h100");
    // the default window (180 s) with a tick of an hour: refused
    let e = leasing(&format!("tick_ms = 3600000\n{PROCESS}{hourly}"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("leasing.release_window_secs = 180 (the default)")
            && e.contains("'h100'")
            && e.contains("at least 3603"),
        "{e}"
    );
    // a window of 3 s with a 500 ms tick: a release takes 3 s
    let e = leasing(&format!(
        "tick_ms = 500\nrelease_window_secs = 3\n{PROCESS}{hourly}"
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("at least 4"), "{e}");
    leasing(&format!(
        "tick_ms = 500\nrelease_window_secs = 4\n{PROCESS}{hourly}"
    ))
    .unwrap();
    // per-second billing (cpu-32) past its minimum has no block to
    // miss, and the other policies do not use the window
    leasing(&format!(
        "tick_ms = 500\nrelease_window_secs = 1\n{PROCESS}{MODEL}"
    ))
    .unwrap();
    leasing(&format!(
        "policy = \"tidal\"\ntick_ms = 3600000\n{PROCESS}{hourly}"
    ))
    .unwrap();
}

const SLURM: &str = "[leasing.slurm]\ncommand = \"tidegate-worker\"\nslurm_conf = \"slurm.conf\"\npartitions = { on_demand = \"gpu\", spot = \"spot\" }\ngres = { h100 = \"gpu:h100:1\" }\n";

#[test]
fn a_slurm_section_validates_and_its_errors_name_the_field() {
    let slurm = |extra: &str| -> Result<(), ConfigError> {
        let text = format!("[leasing]\nprovider = \"slurm\"\nledger = \"l.db\"\n{MODEL}{extra}\n");
        let cfg: Config = toml::from_str(&text).map_err(|e| ConfigError::Invalid(e.to_string()))?;
        cfg.validate()
    };
    slurm(SLURM).unwrap();
    let e = slurm("").unwrap_err().to_string();
    assert!(
        e.contains("[leasing.slurm]") && e.contains("partitions"),
        "{e}"
    );
    let e = slurm(&SLURM.replace("h100 =", "tpu ="))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("leasing.slurm.gres") && e.contains("'tpu'"),
        "{e}"
    );
    let e = slurm(&SLURM.replace("spot = \"spot\"", "spot = \"a b\""))
        .unwrap_err()
        .to_string();
    assert!(e.contains("leasing.slurm.partitions.spot"), "{e}");
    let e = slurm(&format!("{SLURM}{PROCESS}")).unwrap_err().to_string();
    assert!(
        e.contains("[leasing.process] is only used with provider = \"process\""),
        "{e}"
    );
    let e = slurm(&SLURM.replace("partitions", "partition"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("partition"), "{e}");
}

const KUBERNETES: &str = "[leasing.kubernetes]\nimage = \"w:1\"\nkubeconfig = \"kube/config\"\ngpus = { h100 = 1 }\n[leasing.kubernetes.tiers.on_demand]\n[leasing.kubernetes.tiers.spot]\nnode_selector = { \"cloud.google.com/gke-spot\" = \"true\" }\n";

#[test]
fn a_kubernetes_section_validates_and_its_errors_name_the_field() {
    let kube = |extra: &str| -> Result<Config, ConfigError> {
        let text =
            format!("[leasing]\nprovider = \"kubernetes\"\nledger = \"l.db\"\n{MODEL}{extra}\n");
        let cfg: Config = toml::from_str(&text).map_err(|e| ConfigError::Invalid(e.to_string()))?;
        cfg.validate().map(|()| cfg)
    };
    let cfg = kube(KUBERNETES).unwrap();
    let k = cfg.leasing.unwrap().kubernetes.unwrap();
    assert!(k.tiers.spot.is_some() && k.tiers.on_demand.is_some());
    let e = kube("").unwrap_err().to_string();
    assert!(
        e.contains("[leasing.kubernetes]") && e.contains("image"),
        "{e}"
    );
    let e = kube(&KUBERNETES.replace("h100 =", "tpu ="))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("leasing.kubernetes.gpus") && e.contains("'tpu'"),
        "{e}"
    );
    let e = kube(&KUBERNETES.replace("\"true\"", "\"a b\""))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("leasing.kubernetes.tiers.spot.node_selector"),
        "{e}"
    );
    let e = kube(&format!("{KUBERNETES}{SLURM}"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("[leasing.slurm] is only used with provider = \"slurm\""),
        "{e}"
    );
    let e = kube(&KUBERNETES.replace("image", "images"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("images"), "{e}");
}

#[test]
fn on_stop_keep_is_for_providers_whose_workers_are_adopted() {
    let parse = |provider: &str, section: &str, on_stop: &str| -> Result<Config, ConfigError> {
        let text = format!(
            "[leasing]\nprovider = \"{provider}\"\nledger = \"l.db\"\n{on_stop}{MODEL}{section}\n"
        );
        let cfg: Config = toml::from_str(&text).map_err(|e| ConfigError::Invalid(e.to_string()))?;
        cfg.validate().map(|()| cfg)
    };
    let cfg = parse("kubernetes", KUBERNETES, "").unwrap();
    assert_eq!(cfg.leasing.unwrap().on_stop, OnStop::Release);
    for (provider, section) in [
        ("kubernetes", KUBERNETES),
        ("slurm", SLURM),
        ("process", PROCESS),
    ] {
        let cfg = parse(provider, section, "on_stop = \"keep\"\n").unwrap();
        assert_eq!(cfg.leasing.unwrap().on_stop, OnStop::Keep, "{provider}");
    }
    let statics = format!(
        "[[leasing.static_workers]]\nname = \"w\"\ninstance_type = \"h100\"\ntier = \"on_demand\"\ntoken_sha256 = \"{}\"\n",
        "a".repeat(64)
    );
    parse("static", &statics, "").unwrap();
    let e = parse("static", &statics, "on_stop = \"keep\"\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("on_stop") && e.contains("static"), "{e}");
    let e = parse("process", PROCESS, "on_stop = \"hold\"\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("hold"), "{e}");
}

#[test]
fn leasing_paths_resolve_against_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("g.toml");
    std::fs::write(
        &p,
        format!("[leasing]\nprovider = \"process\"\nledger = \"data/l.db\"\n{PROCESS}{MODEL}"),
    )
    .unwrap();
    let cfg = Config::load(&p).unwrap();
    let l = cfg.leasing.unwrap();
    assert_eq!(l.ledger, dir.path().join("data/l.db"));
    assert_eq!(l.process.unwrap().notice_period_secs, 120.0);
    std::fs::write(
        &p,
        format!("[leasing]\nprovider = \"slurm\"\nledger = \"l.db\"\n{SLURM}{MODEL}"),
    )
    .unwrap();
    let l = Config::load(&p).unwrap().leasing.unwrap();
    assert_eq!(
        l.slurm.unwrap().slurm_conf,
        Some(dir.path().join("slurm.conf"))
    );
    std::fs::write(
        &p,
        format!("[leasing]\nprovider = \"kubernetes\"\nledger = \"l.db\"\n{KUBERNETES}{MODEL}"),
    )
    .unwrap();
    let l = Config::load(&p).unwrap().leasing.unwrap();
    assert_eq!(
        l.kubernetes.unwrap().kubeconfig,
        Some(dir.path().join("kube/config"))
    );
}
