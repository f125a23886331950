//! deploy/kubernetes/ against the gateway that it runs:
//!
//! - every document of every `*.yaml` file is one of the kinds the
//!   deployment uses, deserializes into its k8s-openapi type, and serializes
//!   back to exactly what the file says (k8s-openapi ignores unknown fields,
//!   so a misspelt or misplaced field shows up as a difference, named by its
//!   path);
//! - the Role grants exactly the provider's `REQUIRED_PERMISSIONS`, and is
//!   bound to the Deployment's service account, all in one namespace;
//! - the ConfigMap's `gateway.toml` loads and validates with the gateway's
//!   own loader, and agrees with the Deployment and the Services: ports,
//!   probes, the paths of its certificate, key and ledger, the namespace,
//!   and the worker Pods' gateway address, CA and configuration;
//! - every Secret, ConfigMap and claim a Pod mounts is defined here or is
//!   one that README.md says to create by command.
//!
//! Each check returns what is wrong instead of panicking, and the tests at
//! the end break a copy of the manifests to show that each one can fail.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, ContainerPort, Namespace, PersistentVolumeClaim, PodSpec, Probe, Service,
    ServiceAccount, Volume,
};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::Serialize;
use serde::de::{Deserialize, DeserializeOwned};
use serde_json::Value;
use tidegate_deploy::{assert_ok, workspace_root};
use tidegate_gateway::config::{Config, ProviderKind};
use tidegate_lease::provider::kubernetes::{KubernetesConfig, REQUIRED_PERMISSIONS};

/// Objects the manifests use but do not define, because they hold what is
/// never committed: README.md says to create each by command.
const CREATED_BY_COMMAND: &[(&str, &str)] = &[
    ("Secret", "tidegate-gateway-tls"),
    ("Secret", "tidegate-ca"),
];

/// The keys of a Secret made by `kubectl create secret tls`.
const TLS_CERT_KEY: &str = "tls.crt";
const TLS_KEY_KEY: &str = "tls.key";

fn manifests_dir() -> PathBuf {
    workspace_root().join("deploy/kubernetes")
}

/// Every object of the manifests, by kind, in file order.
#[derive(Debug, Clone, Default)]
struct Manifests {
    namespaces: Vec<Namespace>,
    service_accounts: Vec<ServiceAccount>,
    roles: Vec<Role>,
    role_bindings: Vec<RoleBinding>,
    config_maps: Vec<ConfigMap>,
    claims: Vec<PersistentVolumeClaim>,
    deployments: Vec<Deployment>,
    services: Vec<Service>,
}

impl Manifests {
    /// Adds one document (YAML read as JSON); `at` says where it is.
    fn add(&mut self, doc: &Value, at: &str) -> Result<(), String> {
        let kind = doc
            .get("kind")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("{at}: no `kind`"))?;
        match kind {
            "Namespace" => self.namespaces.push(typed(doc, at)?),
            "ServiceAccount" => self.service_accounts.push(typed(doc, at)?),
            "Role" => self.roles.push(typed(doc, at)?),
            "RoleBinding" => self.role_bindings.push(typed(doc, at)?),
            "ConfigMap" => self.config_maps.push(typed(doc, at)?),
            "PersistentVolumeClaim" => self.claims.push(typed(doc, at)?),
            "Deployment" => self.deployments.push(typed(doc, at)?),
            "Service" => self.services.push(typed(doc, at)?),
            other => {
                return Err(format!(
                    "{at}: kind {other:?} is not one of the gateway's manifests (Namespace, \
                     ServiceAccount, Role, RoleBinding, ConfigMap, PersistentVolumeClaim, \
                     Deployment, Service); a new kind needs a case here, and its checks"
                ));
            }
        }
        Ok(())
    }

    /// Adds every document of a YAML file's text.
    fn add_file(&mut self, text: &str, file: &str) -> Result<(), String> {
        for (i, de) in serde_yaml::Deserializer::from_str(text).enumerate() {
            let at = format!("{file}, document {}", i + 1);
            let doc = Value::deserialize(de).map_err(|e| format!("{at}: not YAML: {e}"))?;
            if doc.is_null() {
                continue; // an empty document (a stray `---`)
            }
            self.add(&doc, &at)?;
        }
        Ok(())
    }

    /// Every `*.yaml` file of deploy/kubernetes/.
    fn load() -> Result<Manifests, String> {
        let mut m = Manifests::default();
        for path in yaml_files() {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let text = std::fs::read_to_string(&path).map_err(|e| format!("{name}: {e}"))?;
            m.add_file(&text, &name)?;
        }
        Ok(m)
    }

    /// The one object of a kind.
    fn one<'a, T>(list: &'a [T], kind: &str) -> Result<&'a T, String> {
        match list {
            [one] => Ok(one),
            _ => Err(format!("expected exactly one {kind}, found {}", list.len())),
        }
    }

    fn namespace(&self) -> Result<String, String> {
        let ns = Self::one(&self.namespaces, "Namespace")?;
        ns.metadata
            .name
            .clone()
            .ok_or_else(|| "the Namespace has no name".into())
    }

    fn deployment(&self) -> Result<&Deployment, String> {
        Self::one(&self.deployments, "Deployment")
    }

    fn config_map(&self, name: &str) -> Option<&ConfigMap> {
        self.config_maps
            .iter()
            .find(|c| c.metadata.name.as_deref() == Some(name))
    }

    /// The gateway's container and its Pod spec.
    fn gateway_pod(&self) -> Result<(&PodSpec, &Container), String> {
        let spec = self
            .deployment()?
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .ok_or("the Deployment has no Pod spec")?;
        let c = Self::one(&spec.containers, "container in the gateway's Pod")?;
        Ok((spec, c))
    }
}

fn yaml_files() -> Vec<PathBuf> {
    let dir = manifests_dir();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
        .collect();
    files.sort();
    files
}

/// `doc` as a `T`, which must serialize back to `doc` exactly.
fn typed<T: DeserializeOwned + Serialize>(doc: &Value, at: &str) -> Result<T, String> {
    let obj: T = serde_json::from_value(doc.clone()).map_err(|e| format!("{at}: {e}"))?;
    let back = serde_json::to_value(&obj).map_err(|e| format!("{at}: {e}"))?;
    match first_difference(doc, &back, "$") {
        None => Ok(obj),
        Some(d) => Err(format!(
            "{at}: {d} (a misspelt or misplaced field, or a value written in another form \
             than Kubernetes' own: quote quantities and annotation values)"
        )),
    }
}

/// The first place where `file` (as written) and `typed` (after the round
/// trip) differ, as a JSON path and what each has there.
fn first_difference(file: &Value, typed: &Value, path: &str) -> Option<String> {
    match (file, typed) {
        (Value::Object(a), Value::Object(b)) => {
            let keys: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for k in keys {
                let p = if k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                    format!("{path}.{k}")
                } else {
                    format!("{path}[{k:?}]")
                };
                match (a.get(k), b.get(k)) {
                    (Some(x), Some(y)) => {
                        if let Some(d) = first_difference(x, y, &p) {
                            return Some(d);
                        }
                    }
                    (Some(x), None) => {
                        return Some(format!("{p} = {x} is in the file but not in the type"));
                    }
                    (None, Some(y)) => {
                        return Some(format!("{p} = {y} appears after the round trip"));
                    }
                    (None, None) => unreachable!(),
                }
            }
            None
        }
        (Value::Array(a), Value::Array(b)) => {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                if let Some(d) = first_difference(x, y, &format!("{path}[{i}]")) {
                    return Some(d);
                }
            }
            (a.len() != b.len()).then(|| {
                format!(
                    "{path} has {} items in the file, {} after the round trip",
                    a.len(),
                    b.len()
                )
            })
        }
        (a, b) if a == b => None,
        (a, b) => Some(format!(
            "{path} is {a} in the file, {b} after the round trip"
        )),
    }
}

/// Whether `path` lies strictly below the directory `dir`.
fn lies_under(path: &str, dir: &str) -> bool {
    let (p, d) = (Path::new(path), Path::new(dir));
    p != d && p.starts_with(d)
}

fn name_of(meta: &ObjectMeta) -> &str {
    meta.name.as_deref().unwrap_or("<unnamed>")
}

// ---------------------------------------------------------------- namespace

/// One Namespace; every other object lives in it.
fn check_namespace(m: &Manifests) -> Vec<String> {
    let ns = match m.namespace() {
        Ok(ns) => ns,
        Err(e) => return vec![e],
    };
    let metas: Vec<(&str, &ObjectMeta)> = m
        .service_accounts
        .iter()
        .map(|o| ("ServiceAccount", &o.metadata))
        .chain(m.roles.iter().map(|o| ("Role", &o.metadata)))
        .chain(m.role_bindings.iter().map(|o| ("RoleBinding", &o.metadata)))
        .chain(m.config_maps.iter().map(|o| ("ConfigMap", &o.metadata)))
        .chain(
            m.claims
                .iter()
                .map(|o| ("PersistentVolumeClaim", &o.metadata)),
        )
        .chain(m.deployments.iter().map(|o| ("Deployment", &o.metadata)))
        .chain(m.services.iter().map(|o| ("Service", &o.metadata)))
        .collect();
    metas
        .into_iter()
        .filter(|(_, meta)| meta.namespace.as_deref() != Some(ns.as_str()))
        .map(|(kind, meta)| {
            format!(
                "{kind} {} is in namespace {:?}, not {ns:?}",
                name_of(meta),
                meta.namespace
            )
        })
        .collect()
}

// --------------------------------------------------------------------- RBAC

/// The Role grants exactly `REQUIRED_PERMISSIONS`, to the Deployment's
/// service account, which is defined here.
fn check_rbac(m: &Manifests) -> Vec<String> {
    let mut problems = Vec::new();
    let (ns, role, binding, deployment) = match (
        m.namespace(),
        Manifests::one(&m.roles, "Role"),
        Manifests::one(&m.role_bindings, "RoleBinding"),
        m.gateway_pod(),
    ) {
        (Ok(n), Ok(r), Ok(b), Ok((spec, _))) => (n, r, b, spec),
        (n, r, b, d) => {
            return [n.err(), r.err(), b.err(), d.err()]
                .into_iter()
                .flatten()
                .collect();
        }
    };
    let required: BTreeSet<(String, String, String)> = REQUIRED_PERMISSIONS
        .iter()
        .flat_map(|(group, resource, verbs)| {
            verbs
                .iter()
                .map(|v| (group.to_string(), resource.to_string(), v.to_string()))
        })
        .collect();
    let mut granted = BTreeSet::new();
    for (i, rule) in role.rules.iter().flatten().enumerate() {
        if rule.resource_names.is_some() || rule.non_resource_urls.is_some() {
            problems.push(format!(
                "Role rule {i}: resourceNames or nonResourceURLs; the provider names its Pods per lease"
            ));
        }
        for g in rule.api_groups.iter().flatten() {
            for r in rule.resources.iter().flatten() {
                for v in &rule.verbs {
                    granted.insert((g.clone(), r.clone(), v.clone()));
                }
            }
        }
    }
    for (g, r, v) in required.difference(&granted) {
        problems.push(format!(
            "the Role does not grant {v} on {r} (API group {g:?}), which the Kubernetes provider needs (REQUIRED_PERMISSIONS)"
        ));
    }
    for (g, r, v) in granted.difference(&required) {
        problems.push(format!(
            "the Role grants {v} on {r} (API group {g:?}), which the provider does not need (REQUIRED_PERMISSIONS): least privilege"
        ));
    }
    let role_name = name_of(&role.metadata);
    let rr = &binding.role_ref;
    if rr.kind != "Role" || rr.name != role_name || rr.api_group != "rbac.authorization.k8s.io" {
        problems.push(format!(
            "RoleBinding {} refers to {} {:?} ({}), not Role {role_name:?}",
            name_of(&binding.metadata),
            rr.kind,
            rr.name,
            rr.api_group
        ));
    }
    let account = deployment.service_account_name.as_deref();
    match account {
        None => problems
            .push("the Deployment sets no serviceAccountName, so it runs without the Role".into()),
        Some(sa) => {
            let subjects = binding.subjects.as_deref().unwrap_or_default();
            let bound = matches!(subjects, [s] if s.kind == "ServiceAccount"
                && s.name == sa
                && s.namespace.as_deref() == Some(ns.as_str()));
            if !bound {
                problems.push(format!(
                    "RoleBinding {} must bind exactly the Deployment's ServiceAccount {sa:?} in {ns:?}, not {subjects:?}",
                    name_of(&binding.metadata)
                ));
            }
            if !m
                .service_accounts
                .iter()
                .any(|s| s.metadata.name.as_deref() == Some(sa))
            {
                problems.push(format!(
                    "the Deployment's ServiceAccount {sa:?} is not defined"
                ));
            }
        }
    }
    problems
}

// ------------------------------------------------------------ gateway.toml

fn flag_value<'a>(args: &'a [String], long: &str) -> Option<&'a str> {
    let eq = format!("{long}=");
    args.iter().enumerate().find_map(|(i, a)| {
        if a == long {
            args.get(i + 1).map(String::as_str)
        } else {
            a.strip_prefix(&eq)
        }
    })
}

/// The volume mounted at the directory that holds `path`, with the mount.
fn volume_holding<'a>(
    spec: &'a PodSpec,
    c: &'a Container,
    path: &str,
) -> Option<(&'a Volume, &'a k8s_openapi::api::core::v1::VolumeMount)> {
    let mount = c
        .volume_mounts
        .iter()
        .flatten()
        .filter(|vm| lies_under(path, &vm.mount_path))
        .max_by_key(|vm| vm.mount_path.len())?;
    let volume = spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)?;
    Some((volume, mount))
}

/// The file `path` as the key of the ConfigMap mounted over its directory.
fn config_map_file<'a>(
    m: &'a Manifests,
    spec: &PodSpec,
    c: &Container,
    path: &str,
) -> Result<&'a str, String> {
    let (volume, mount) = volume_holding(spec, c, path)
        .ok_or_else(|| format!("no volume is mounted where {path} is"))?;
    let cm = volume.config_map.as_ref().ok_or_else(|| {
        format!(
            "{path} is on volume {:?}, which is not a ConfigMap",
            volume.name
        )
    })?;
    if mount.sub_path.is_some() || cm.items.is_some() {
        return Err(format!(
            "volume {:?}: mount the whole ConfigMap (no subPath, no items), so that edits reach the file",
            volume.name
        ));
    }
    let key = Path::new(path)
        .strip_prefix(&mount.mount_path)
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let map = m
        .config_map(&cm.name)
        .ok_or_else(|| format!("ConfigMap {:?} is not defined", cm.name))?;
    map.data
        .as_ref()
        .and_then(|d| d.get(&key))
        .map(String::as_str)
        .ok_or_else(|| format!("ConfigMap {:?} has no key {key:?} for {path}", cm.name))
}

/// The gateway's config, as its own loader reads and validates it, from
/// the ConfigMap that the Deployment's `--config` points into.
fn load_gateway_config(m: &Manifests) -> Result<Config, String> {
    let (spec, c) = m.gateway_pod()?;
    let args = c.args.as_deref().unwrap_or_default();
    let path = flag_value(args, "--config")
        .or_else(|| flag_value(args, "-c"))
        .ok_or_else(|| format!("the gateway's args {args:?} have no --config"))?;
    let text = config_map_file(m, spec, c, path)?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let file = dir.path().join("gateway.toml");
    std::fs::write(&file, text).map_err(|e| e.to_string())?;
    let config = Config::load(&file).map_err(|e| format!("gateway.toml: {e}"))?;
    config
        .validate()
        .map_err(|e| format!("gateway.toml: {e}"))?;
    Ok(config)
}

fn kubernetes_of(config: &Config) -> Result<&KubernetesConfig, String> {
    let l = config
        .leasing
        .as_ref()
        .ok_or("gateway.toml has no [leasing]")?;
    if l.provider != ProviderKind::Kubernetes {
        return Err(format!(
            "gateway.toml: [leasing] provider is {:?}, not kubernetes",
            l.provider
        ));
    }
    l.kubernetes
        .as_ref()
        .ok_or_else(|| "gateway.toml has no [leasing.kubernetes]".into())
}

/// The container port a Service's or probe's port refers to.
fn resolve<'a>(c: &'a Container, port: &IntOrString) -> Option<&'a ContainerPort> {
    c.ports.iter().flatten().find(|p| match port {
        IntOrString::Int(n) => p.container_port == *n,
        IntOrString::String(s) => p.name.as_deref() == Some(s.as_str()),
    })
}

fn protocol(p: &Option<String>) -> &str {
    p.as_deref().unwrap_or("TCP")
}

/// Whether a Service's selector picks the gateway's Pods.
fn selects(selector: Option<&BTreeMap<String, String>>, labels: &BTreeMap<String, String>) -> bool {
    selector.is_some_and(|s| !s.is_empty() && s.iter().all(|(k, v)| labels.get(k) == Some(v)))
}

/// gateway.toml against the Deployment and the Services: listeners,
/// ports, probes, scrape annotations, file paths, namespace.
fn check_gateway(m: &Manifests) -> Vec<String> {
    let config = match load_gateway_config(m) {
        Ok(config) => config,
        Err(e) => return vec![e],
    };
    let (Ok(ns), Ok(d), Ok((spec, c))) = (m.namespace(), m.deployment(), m.gateway_pod()) else {
        return vec!["the namespace or the Deployment is missing".into()];
    };
    let cfg = &config;
    let mut problems = Vec::new();
    let mut bad = |s: String| problems.push(s);

    let k = match kubernetes_of(cfg) {
        Ok(k) => k,
        Err(e) => return vec![e],
    };
    if k.namespace.as_deref() != Some(ns.as_str()) {
        bad(format!(
            "[leasing.kubernetes] namespace is {:?}, the manifests' is {ns:?}",
            k.namespace
        ));
    }

    // Listeners: reachable from outside the Pod, on the container's ports.
    let listeners = [
        ("quic.listen", cfg.quic.listen, "UDP"),
        ("http.listen", cfg.http.listen, "TCP"),
    ];
    for (field, addr, proto) in listeners {
        if !addr.ip().is_unspecified() {
            bad(format!(
                "gateway.toml {field} = {addr}: only the Pod itself could reach it; listen on 0.0.0.0"
            ));
        }
        let declared: Vec<i32> = c
            .ports
            .iter()
            .flatten()
            .filter(|p| protocol(&p.protocol) == proto)
            .map(|p| p.container_port)
            .collect();
        if declared != [i32::from(addr.port())] {
            bad(format!(
                "gateway.toml {field} port {} is not the container's one {proto} port ({declared:?})",
                addr.port()
            ));
        }
    }
    let http_port = i32::from(cfg.http.listen.port());
    for v in c.env.iter().flatten() {
        if [
            "TIDEGATE_QUIC_LISTEN",
            "TIDEGATE_HTTP_LISTEN",
            "TIDEGATE_GATEWAY_CONFIG",
        ]
        .contains(&v.name.as_str())
        {
            bad(format!(
                "env {} overrides gateway.toml; keep the layout in the file",
                v.name
            ));
        }
    }
    let args = c.args.as_deref().unwrap_or_default();
    for flag in ["--quic-listen", "--http-listen"] {
        if flag_value(args, flag).is_some() {
            bad(format!(
                "args {flag} overrides gateway.toml; keep the layout in the file"
            ));
        }
    }

    // Probes on the HTTP listener.
    let probes: [(&str, &Option<Probe>, Option<&str>); 3] = [
        ("readinessProbe", &c.readiness_probe, Some("/readyz")),
        ("livenessProbe", &c.liveness_probe, Some("/healthz")),
        ("startupProbe", &c.startup_probe, None),
    ];
    for (name, probe, want_path) in probes {
        let Some(probe) = probe else {
            if want_path.is_some() {
                bad(format!("the gateway has no {name}"));
            }
            continue;
        };
        let Some(get) = &probe.http_get else {
            bad(format!("{name} is not an httpGet on the HTTP listener"));
            continue;
        };
        match resolve(c, &get.port) {
            Some(p) if p.container_port == http_port && protocol(&p.protocol) == "TCP" => {}
            _ => bad(format!(
                "{name} port {:?} is not the HTTP listener's ({http_port})",
                get.port
            )),
        }
        let path = get.path.as_deref().unwrap_or("/");
        if !["/healthz", "/readyz"].contains(&path) || want_path.is_some_and(|w| w != path) {
            bad(format!(
                "{name} asks {path}; want {}",
                want_path.unwrap_or("/healthz or /readyz")
            ));
        }
    }

    // Prometheus finds /metrics on the HTTP listener.
    let template = d.spec.as_ref().map(|s| &s.template.metadata);
    let annotations = template
        .and_then(|t| t.as_ref())
        .and_then(|t| t.annotations.clone())
        .unwrap_or_default();
    let want = [
        ("prometheus.io/scrape", "true".to_string()),
        ("prometheus.io/port", http_port.to_string()),
        ("prometheus.io/path", "/metrics".to_string()),
    ];
    for (key, value) in want {
        if annotations.get(key) != Some(&value) {
            bad(format!(
                "Pod annotation {key} is {:?}, want {value:?}",
                annotations.get(key)
            ));
        }
    }

    // Services: every port goes to the listener of its protocol; the
    // gateway's Pods are published before they are ready, since /readyz
    // waits for a worker that registers through a Service.
    let labels = template
        .and_then(|t| t.as_ref())
        .and_then(|t| t.labels.clone())
        .unwrap_or_default();
    let quic_port = i32::from(cfg.quic.listen.port());
    let mut edges_reach_quic = false;
    for s in &m.services {
        let name = name_of(&s.metadata);
        let Some(sspec) = &s.spec else {
            bad(format!("Service {name} has no spec"));
            continue;
        };
        // the HTTP API and /metrics stay inside the cluster
        let external = matches!(sspec.type_.as_deref(), Some("LoadBalancer" | "NodePort"));
        for p in sspec.ports.iter().flatten() {
            match protocol(&p.protocol) {
                "UDP" if external => edges_reach_quic = true,
                "UDP" => {}
                _ if external => bad(format!(
                    "Service {name} ({}) exposes TCP port {} outside the cluster: the HTTP API must stay private",
                    sspec.type_.as_deref().unwrap_or_default(),
                    p.port
                )),
                _ => {}
            }
        }
        if !selects(sspec.selector.as_ref(), &labels) {
            bad(format!(
                "Service {name}'s selector {:?} does not pick the gateway's Pods ({labels:?})",
                sspec.selector
            ));
        }
        if sspec.publish_not_ready_addresses != Some(true) {
            bad(format!(
                "Service {name} must set publishNotReadyAddresses: the gateway is not ready until a worker registers, and workers and edges must reach it before"
            ));
        }
        for p in sspec.ports.iter().flatten() {
            let target = p.target_port.clone().unwrap_or(IntOrString::Int(p.port));
            let want = match protocol(&p.protocol) {
                "UDP" => quic_port,
                _ => http_port,
            };
            match resolve(c, &target) {
                Some(cp)
                    if cp.container_port == want
                        && protocol(&cp.protocol) == protocol(&p.protocol) => {}
                _ => bad(format!(
                    "Service {name} port {} ({}) targets {target:?}, not the gateway's {} listener on {want}",
                    p.port,
                    protocol(&p.protocol),
                    protocol(&p.protocol)
                )),
            }
        }
    }

    if !edges_reach_quic {
        bad(
            "no LoadBalancer (or NodePort) Service takes the edges' QUIC from outside the cluster"
                .into(),
        );
    }

    // Files: the certificate and key in the TLS Secret's volume, the ledger
    // on the claim's writable volume.
    let tls_files = [
        ("quic.cert", &cfg.quic.cert, TLS_CERT_KEY),
        ("quic.key", &cfg.quic.key, TLS_KEY_KEY),
    ];
    for (field, path, key) in tls_files {
        let path = path.to_string_lossy();
        match volume_holding(spec, c, &path) {
            Some((v, vm)) => match &v.secret {
                Some(sec) if sec.items.is_none() && vm.sub_path.is_none() => {
                    let file = Path::new(&*path).strip_prefix(&vm.mount_path).unwrap();
                    if file != Path::new(key) {
                        bad(format!(
                            "gateway.toml {field} = {path}: the Secret {:?} (kubectl create secret tls) has it as {key}",
                            sec.secret_name
                        ));
                    }
                }
                Some(_) => bad(format!(
                    "volume {:?}: mount the whole TLS Secret (no items, no subPath), so that a renewal reaches the files",
                    v.name
                )),
                None => bad(format!(
                    "gateway.toml {field} = {path} is on volume {:?}, which is not a Secret",
                    v.name
                )),
            },
            None => bad(format!(
                "gateway.toml {field} = {path} is on no volume of the Pod"
            )),
        }
    }
    if let Some(l) = &cfg.leasing {
        let ledger = l.ledger.to_string_lossy();
        match volume_holding(spec, c, &ledger) {
            Some((v, vm)) => {
                match &v.persistent_volume_claim {
                    Some(claim) => {
                        let defined = m
                            .claims
                            .iter()
                            .find(|p| p.metadata.name.as_deref() == Some(&claim.claim_name));
                        let rwo = defined
                            .and_then(|p| p.spec.as_ref())
                            .and_then(|s| s.access_modes.as_ref())
                            .is_some_and(|a| a == &["ReadWriteOnce".to_string()]);
                        if !rwo {
                            bad(format!(
                                "the ledger's claim {:?} must be defined, ReadWriteOnce (one writer)",
                                claim.claim_name
                            ));
                        }
                    }
                    None => bad(format!(
                        "gateway.toml leasing.ledger = {ledger} is on volume {:?}, not a PersistentVolumeClaim: the ledger would not outlive the Pod",
                        v.name
                    )),
                }
                if vm.read_only == Some(true) || vm.sub_path.is_some() {
                    bad(format!(
                        "the ledger's mount {} must be writable and whole (SQLite writes its -wal and -shm files beside it)",
                        vm.mount_path
                    ));
                }
            }
            None => bad(format!(
                "gateway.toml leasing.ledger = {ledger} is on no volume of the Pod"
            )),
        }
    }
    // Read-only root filesystem: everything else read-only too.
    for vm in c.volume_mounts.iter().flatten() {
        let config_or_secret = spec
            .volumes
            .iter()
            .flatten()
            .any(|v| v.name == vm.name && (v.config_map.is_some() || v.secret.is_some()));
        if config_or_secret && vm.read_only != Some(true) {
            bad(format!("mount {} should be readOnly", vm.mount_path));
        }
    }
    problems
}

/// The Deployment: one replica, recreated, non-root and read-only, with
/// time to release its leases.
fn check_deployment(m: &Manifests) -> Vec<String> {
    let (d, (spec, c)) = match (m.deployment(), m.gateway_pod()) {
        (Ok(d), Ok(p)) => (d, p),
        (d, p) => return [d.err(), p.err()].into_iter().flatten().collect(),
    };
    let mut problems = Vec::new();
    let mut bad = |s: String| problems.push(s);
    let dspec = d.spec.as_ref().unwrap();
    if dspec.replicas != Some(1) {
        bad(format!(
            "replicas is {:?}: one gateway owns the ledger and the worker Pods",
            dspec.replicas
        ));
    }
    let strategy = dspec.strategy.as_ref().and_then(|s| s.type_.as_deref());
    if strategy != Some("Recreate") {
        bad(format!(
            "strategy is {strategy:?}: Recreate, so that two gateways never share the ledger"
        ));
    }
    let labels = dspec
        .template
        .metadata
        .as_ref()
        .and_then(|t| t.labels.as_ref());
    let matched = dspec
        .selector
        .match_labels
        .as_ref()
        .is_some_and(|sel| labels.is_some_and(|l| selects(Some(sel), l)));
    if !matched {
        bad("the Deployment's selector does not match its Pod template's labels".into());
    }
    let pod_sc = spec.security_context.as_ref();
    let sc = c.security_context.as_ref();
    let non_root = sc
        .and_then(|s| s.run_as_non_root)
        .or(pod_sc.and_then(|s| s.run_as_non_root));
    if non_root != Some(true) {
        bad("runAsNonRoot is not set".into());
    }
    if sc.and_then(|s| s.read_only_root_filesystem) != Some(true) {
        bad("readOnlyRootFilesystem is not set".into());
    }
    if sc.and_then(|s| s.allow_privilege_escalation) != Some(false) {
        bad("allowPrivilegeEscalation is not false".into());
    }
    let drops = sc
        .and_then(|s| s.capabilities.as_ref())
        .and_then(|c| c.drop.as_ref())
        .is_some_and(|d| d.iter().any(|x| x == "ALL"));
    if !drops {
        bad("capabilities do not drop ALL".into());
    }
    let resources = c.resources.as_ref();
    if resources.and_then(|r| r.requests.as_ref()).is_none()
        || resources.and_then(|r| r.limits.as_ref()).is_none()
    {
        bad("the gateway's container needs resource requests and limits".into());
    }
    if let Ok(cfg) = load_gateway_config(m)
        && let Ok(k) = kubernetes_of(&cfg)
    {
        // A clean stop releases every lease; one release can take a
        // worker's grace period, or the provider's release timeout.
        let grace = spec.termination_grace_period_seconds.unwrap_or(30);
        let one_release = f64::from(k.termination_grace_period_secs).max(k.release_timeout_secs);
        if (grace as f64) < one_release {
            bad(format!(
                "terminationGracePeriodSeconds = {grace} is shorter than one lease release may take ({one_release} s): the gateway releases its leases on SIGTERM"
            ));
        }
    }
    problems
}

// ----------------------------------------------------------------- workers

/// The worker Pods that `[leasing.kubernetes]` describes: they reach the
/// gateway's Service, trust the mounted CA, and read a configuration that
/// is defined here.
fn check_workers(m: &Manifests) -> Vec<String> {
    let cfg = match load_gateway_config(m) {
        Ok(cfg) => cfg,
        Err(e) => return vec![e],
    };
    let k = match kubernetes_of(&cfg) {
        Ok(k) => k,
        Err(e) => return vec![e],
    };
    let (Ok(ns), Ok((_, c))) = (m.namespace(), m.gateway_pod()) else {
        return vec!["the namespace or the Deployment is missing".into()];
    };
    let mut problems = Vec::new();
    let mut bad = |s: String| problems.push(s);

    // The gateway's address: a Service of the manifests, on a UDP port that
    // goes to the QUIC listener.
    let quic_port = i32::from(cfg.quic.listen.port());
    let mut service_host = None;
    match k.env.get("TIDEGATE_GATEWAY_ADDR") {
        None => bad(
            "[leasing.kubernetes] env has no TIDEGATE_GATEWAY_ADDR: the default (the gateway's bound address) is not reachable from other Pods"
                .into(),
        ),
        Some(addr) => {
            let (host, port) = addr.rsplit_once(':').unwrap_or((addr, ""));
            let port: Option<i32> = port.parse().ok();
            let service = m.services.iter().find(|s| {
                let n = name_of(&s.metadata);
                let dns = [
                    format!("{n}.{ns}.svc"),
                    format!("{n}.{ns}.svc.cluster.local"),
                ];
                let fixed_ip = s
                    .spec
                    .as_ref()
                    .and_then(|sp| sp.cluster_ip.as_deref())
                    .filter(|ip| ip.parse::<std::net::IpAddr>().is_ok());
                dns.iter().any(|d| d == host) || fixed_ip == Some(host)
            });
            match service {
                None => bad(format!(
                    "TIDEGATE_GATEWAY_ADDR = {addr:?} names no Service of the manifests (<name>.{ns}.svc:<port>)"
                )),
                Some(s) => {
                    if host.parse::<std::net::IpAddr>().is_err() {
                        service_host = Some(host.to_string());
                    }
                    let sspec = s.spec.as_ref();
                    let ok = sspec.and_then(|sp| sp.ports.as_ref()).is_some_and(|ports| {
                        ports.iter().any(|p| {
                            Some(p.port) == port
                                && protocol(&p.protocol) == "UDP"
                                && resolve(c, p.target_port.as_ref().unwrap_or(&IntOrString::Int(p.port)))
                                    .is_some_and(|cp| cp.container_port == quic_port)
                        })
                    });
                    if !ok {
                        bad(format!(
                            "TIDEGATE_GATEWAY_ADDR = {addr:?}: Service {} has no UDP port {port:?} to the QUIC listener ({quic_port})",
                            name_of(&s.metadata)
                        ));
                    }
                    if sspec.and_then(|sp| sp.type_.as_deref()).unwrap_or("ClusterIP") != "ClusterIP" {
                        bad(format!(
                            "TIDEGATE_GATEWAY_ADDR: Service {} is not a ClusterIP Service; workers stay inside the cluster",
                            name_of(&s.metadata)
                        ));
                    }
                }
            }
        }
    }

    // The CA: a file of a mounted Secret.
    let secret_mounts: Vec<&str> = k
        .mounts
        .iter()
        .filter(|mnt| mnt.secret.is_some())
        .map(|mnt| mnt.path.as_str())
        .collect();
    let ca = k.env.get("TIDEGATE_CA");
    match ca {
        None => bad("[leasing.kubernetes] env has no TIDEGATE_CA".into()),
        Some(ca) if !secret_mounts.iter().any(|d| lies_under(ca, d)) => bad(format!(
            "TIDEGATE_CA = {ca:?} lies under no Secret of [leasing.kubernetes] mounts ({secret_mounts:?})"
        )),
        Some(_) => {}
    }

    // The worker's --config: a key of a ConfigMap mounted into the Pod.
    let args = k.args.as_slice();
    match flag_value(args, "--config").or_else(|| flag_value(args, "-c")) {
        None => bad(format!(
            "[leasing.kubernetes] args {args:?} have no --config; tidegate-worker needs one"
        )),
        Some(path) => {
            let mount = k
                .mounts
                .iter()
                .filter(|mnt| lies_under(path, &mnt.path))
                .max_by_key(|mnt| mnt.path.len());
            let text = mount.and_then(|mnt| {
                let name = mnt.config_map.as_ref()?;
                let key = Path::new(path).strip_prefix(&mnt.path).ok()?;
                m.config_map(name)?
                    .data
                    .as_ref()?
                    .get(&*key.to_string_lossy())
            });
            match text {
                None => bad(format!(
                    "the worker's --config {path} is no key of a ConfigMap in [leasing.kubernetes] mounts"
                )),
                Some(text) => match text.parse::<toml::Table>() {
                    Err(e) => bad(format!("the worker's {path} is not TOML: {e}")),
                    Ok(t) => {
                        let gw = t.get("gateway").and_then(|g| g.as_table());
                        let field = |f: &str| gw.and_then(|g| g.get(f)).and_then(|v| v.as_str());
                        if let Some(ca) = ca
                            && field("ca") != Some(ca.as_str())
                        {
                            bad(format!(
                                "the worker's {path}: gateway.ca = {:?}, TIDEGATE_CA = {ca:?}",
                                field("ca")
                            ));
                        }
                        if let Some(host) = &service_host
                            && field("server_name") != Some(host.as_str())
                        {
                            bad(format!(
                                "the worker's {path}: gateway.server_name = {:?}; it dials {host}, the name the certificate must carry",
                                field("server_name")
                            ));
                        }
                        if field("addr")
                            .and_then(|a| a.parse::<tidegate_protocol::GatewayAddr>().ok())
                            .is_none()
                        {
                            bad(format!(
                                "the worker's {path}: gateway.addr must be a host name or IP address and a port (TIDEGATE_GATEWAY_ADDR overrides it)"
                            ));
                        }
                    }
                },
            }
        }
    }

    // Both tiers the autoscaler uses: spot for bursts, on-demand to fall
    // back on; spot on a spot pool.
    if k.tiers.on_demand.is_none() {
        bad("[leasing.kubernetes.tiers] offers no on_demand: spot refusals have nothing to fall back on".into());
    }
    match &k.tiers.spot {
        None => bad("[leasing.kubernetes.tiers] offers no spot".into()),
        Some(p) if p.node_selector.is_empty() || p.tolerations.is_empty() => bad(
            "[leasing.kubernetes.tiers.spot] needs the spot pool's node selector and the toleration of its taint".into(),
        ),
        Some(_) => {}
    }
    problems
}

// ------------------------------------------------------------ references

/// Every Secret, ConfigMap and claim mounted (by the gateway's Pod, or by
/// the worker Pods through `[leasing.kubernetes] mounts`) is defined here
/// or created by a command that README.md gives.
fn check_references(m: &Manifests, readme: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let mut used: Vec<(&str, String, String)> = Vec::new(); // kind, name, by whom
    if let Ok((spec, _)) = m.gateway_pod() {
        for v in spec.volumes.iter().flatten() {
            let by = format!("the gateway's volume {:?}", v.name);
            if let Some(s) = &v.secret {
                used.push(("Secret", s.secret_name.clone().unwrap_or_default(), by));
            } else if let Some(c) = &v.config_map {
                used.push(("ConfigMap", c.name.clone(), by));
            } else if let Some(p) = &v.persistent_volume_claim {
                used.push(("PersistentVolumeClaim", p.claim_name.clone(), by));
            }
        }
    }
    match load_gateway_config(m).and_then(|cfg| kubernetes_of(&cfg).cloned()) {
        Ok(k) => {
            for (i, mnt) in k.mounts.iter().enumerate() {
                let by = format!("[leasing.kubernetes] mounts[{i}]");
                if let Some(s) = &mnt.secret {
                    used.push(("Secret", s.clone(), by));
                } else if let Some(c) = &mnt.config_map {
                    used.push(("ConfigMap", c.clone(), by));
                }
            }
            for s in &k.image_pull_secrets {
                used.push((
                    "Secret",
                    s.clone(),
                    "[leasing.kubernetes] image_pull_secrets".into(),
                ));
            }
        }
        Err(e) => problems.push(e),
    }
    let defined = |kind: &str, name: &str| match kind {
        "ConfigMap" => m.config_map(name).is_some(),
        "PersistentVolumeClaim" => m
            .claims
            .iter()
            .any(|c| c.metadata.name.as_deref() == Some(name)),
        _ => false,
    };
    for (kind, name, by) in &used {
        let by_command = CREATED_BY_COMMAND.contains(&(*kind, name.as_str()));
        if !defined(kind, name) && !by_command {
            problems.push(format!(
                "{by} uses {kind} {name:?}, which neither the manifests define nor README.md says to create"
            ));
        }
    }
    for (kind, name) in CREATED_BY_COMMAND {
        if !used.iter().any(|(k, n, _)| k == kind && n == name) {
            problems.push(format!(
                "{kind} {name:?} is listed as created by command but nothing uses it"
            ));
        }
        // `kubectl -n tidegate create secret <type> <name>`, possibly
        // across a line continuation
        let joined = readme.replace("\\\n", " ");
        let commanded = joined.lines().any(|l| {
            l.contains("kubectl")
                && l.contains(&format!("create {}", kind.to_ascii_lowercase()))
                && l.split_whitespace().any(|w| w == *name)
        });
        if !commanded {
            problems.push(format!(
                "README.md gives no `kubectl create {}` command for {name:?}",
                kind.to_ascii_lowercase()
            ));
        }
    }
    for f in yaml_files() {
        let f = f.file_name().unwrap().to_string_lossy().into_owned();
        if !readme.contains(&format!("`{f}`")) || !readme.contains(&format!("apply -f {f}")) {
            problems.push(format!(
                "README.md does not describe `{f}` and the `kubectl apply -f {f}` that applies it"
            ));
        }
    }
    problems
}

fn readme() -> String {
    std::fs::read_to_string(manifests_dir().join("README.md")).expect("deploy/kubernetes/README.md")
}

fn manifests() -> Manifests {
    Manifests::load().unwrap_or_else(|e| panic!("{e}"))
}

// ------------------------------------------------------------------ tests

#[test]
fn every_document_is_a_known_kind_and_round_trips_through_its_type() {
    let m = manifests();
    assert_eq!(m.namespaces.len(), 1, "{m:?}");
    assert_eq!(m.deployments.len(), 1);
    assert!(m.roles.len() == 1 && m.role_bindings.len() == 1);
    assert_eq!(m.services.len(), 2);
}

#[test]
fn every_object_is_in_the_namespace() {
    assert_ok(check_namespace(&manifests()));
}

#[test]
fn the_role_grants_exactly_what_the_provider_needs_to_the_gateway() {
    assert_ok(check_rbac(&manifests()));
}

#[test]
fn gateway_toml_validates_and_agrees_with_the_deployment_and_services() {
    let m = manifests();
    load_gateway_config(&m).unwrap_or_else(|e| panic!("{e}"));
    assert_ok(check_gateway(&m));
}

#[test]
fn the_deployment_is_one_recreated_hardened_gateway() {
    assert_ok(check_deployment(&manifests()));
}

#[test]
fn worker_pods_reach_the_gateway_trust_its_ca_and_read_their_config() {
    assert_ok(check_workers(&manifests()));
}

#[test]
fn every_mounted_object_is_defined_or_created_by_a_readme_command() {
    assert_ok(check_references(&manifests(), &readme()));
}

// Each check can fail: break a copy of the manifests and see it named.

/// Replaces text in a ConfigMap's file.
fn edit_file(m: &mut Manifests, config_map: &str, key: &str, from: &str, to: &str) {
    let cm = m
        .config_maps
        .iter_mut()
        .find(|c| c.metadata.name.as_deref() == Some(config_map))
        .unwrap();
    let text = cm.data.as_mut().unwrap().get_mut(key).unwrap();
    assert!(text.contains(from), "{from:?} not in {key}");
    *text = text.replace(from, to);
}

/// Replaces text in the gateway's gateway.toml.
fn edit_gateway_toml(m: &mut Manifests, from: &str, to: &str) {
    edit_file(m, "tidegate-gateway", "gateway.toml", from, to);
}

fn deployment_spec(m: &mut Manifests) -> &mut k8s_openapi::api::apps::v1::DeploymentSpec {
    m.deployments[0].spec.as_mut().unwrap()
}

fn pod(m: &mut Manifests) -> &mut PodSpec {
    deployment_spec(m).template.spec.as_mut().unwrap()
}

fn container(m: &mut Manifests) -> &mut Container {
    &mut pod(m).containers[0]
}

fn service<'a>(
    m: &'a mut Manifests,
    name: &str,
) -> &'a mut k8s_openapi::api::core::v1::ServiceSpec {
    let s = m
        .services
        .iter_mut()
        .find(|s| s.metadata.name.as_deref() == Some(name));
    s.unwrap().spec.as_mut().unwrap()
}

/// The Role's rule on `resource`.
fn rule<'a>(
    m: &'a mut Manifests,
    resource: &str,
) -> &'a mut k8s_openapi::api::rbac::v1::PolicyRule {
    let rules = m.roles[0].rules.as_mut().unwrap().iter_mut();
    let mut on = rules.filter(|r| r.resources.iter().flatten().any(|x| x == resource));
    on.next().unwrap()
}

#[test]
fn a_misspelt_field_or_an_unknown_kind_is_refused_with_its_path() {
    let svc = "apiVersion: v1\nkind: Service\nmetadata:\n  name: s\nspec:\n  ports:\n    - port: 1\n      protocl: UDP\n";
    let e = Manifests::default().add_file(svc, "s.yaml").unwrap_err();
    assert!(e.contains("$.spec.ports[0].protocl"), "{e}");
    let quantity = "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata:\n  name: c\nspec:\n  resources:\n    requests:\n      storage: 1\n";
    let e = Manifests::default()
        .add_file(quantity, "c.yaml")
        .unwrap_err();
    assert!(e.contains("c.yaml, document 1"), "{e}");
    let annotation = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: c\n  annotations:\n    prometheus.io/port: 9090\n";
    let e = Manifests::default()
        .add_file(annotation, "a.yaml")
        .unwrap_err();
    assert!(
        e.contains("a.yaml") && e.contains("expected a string"),
        "{e}"
    );
    let role = "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: n\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata:\n  name: r\n";
    let e = Manifests::default().add_file(role, "r.yaml").unwrap_err();
    assert!(
        e.contains("r.yaml, document 2") && e.contains("ClusterRole"),
        "{e}"
    );
    let wrong_api = "apiVersion: apps/v1\nkind: Service\nmetadata:\n  name: s\n";
    assert!(Manifests::default().add_file(wrong_api, "w.yaml").is_err());
}

#[test]
fn the_checks_fail_on_broken_manifests() {
    type Check = fn(&Manifests) -> Vec<String>;
    type Break = Box<dyn FnOnce(&mut Manifests)>;
    let gw: Check = check_gateway;
    let workers: Check = check_workers;
    let cases: Vec<(&str, Break, Check, &str)> = vec![
        (
            "an object outside the namespace",
            Box::new(|m| m.config_maps[0].metadata.namespace = Some("default".into())),
            check_namespace,
            "not \"tidegate\"",
        ),
        (
            "a verb missing",
            Box::new(|m| rule(m, "pods").verbs.retain(|v| v != "watch")),
            check_rbac,
            "does not grant watch on pods",
        ),
        (
            "a resource beyond pods and secrets",
            Box::new(|m| {
                rule(m, "secrets")
                    .resources
                    .as_mut()
                    .unwrap()
                    .push("configmaps".into())
            }),
            check_rbac,
            "grants create on configmaps",
        ),
        (
            "the binding to another account",
            Box::new(|m| m.role_bindings[0].subjects.as_mut().unwrap()[0].name = "default".into()),
            check_rbac,
            "must bind exactly",
        ),
        (
            "another namespace for the workers",
            Box::new(|m| edit_gateway_toml(m, "namespace = \"tidegate\"", "namespace = \"other\"")),
            gw,
            "namespace is Some(\"other\")",
        ),
        (
            "a container port that is not quic.listen's",
            Box::new(|m| container(m).ports.as_mut().unwrap()[0].container_port = 4434),
            gw,
            "quic.listen port 4433",
        ),
        (
            "a listener on loopback",
            Box::new(|m| edit_gateway_toml(m, "0.0.0.0:9090", "127.0.0.1:9090")),
            gw,
            "listen on 0.0.0.0",
        ),
        (
            "a probe on the QUIC port",
            Box::new(|m| {
                let probe = container(m).readiness_probe.as_mut().unwrap();
                probe.http_get.as_mut().unwrap().port = IntOrString::String("quic".into());
            }),
            gw,
            "readinessProbe port",
        ),
        (
            "a Service to the wrong port",
            Box::new(|m| {
                let ports = service(m, "tidegate-gateway-edge").ports.as_mut().unwrap();
                ports[0].target_port = Some(IntOrString::Int(9090));
            }),
            gw,
            "targets Int(9090)",
        ),
        (
            "the HTTP API on the load balancer",
            Box::new(|m| {
                let http = service(m, "tidegate-gateway").ports.as_ref().unwrap()[1].clone();
                let edge = service(m, "tidegate-gateway-edge");
                edge.ports.as_mut().unwrap().push(http);
            }),
            gw,
            "exposes TCP port 9090 outside the cluster",
        ),
        (
            "a Service gated on readiness",
            Box::new(|m| service(m, "tidegate-gateway").publish_not_ready_addresses = None),
            gw,
            "Service tidegate-gateway must set publishNotReadyAddresses",
        ),
        (
            "the certificate outside the TLS volume",
            Box::new(|m| {
                edit_gateway_toml(m, "/etc/tidegate/tls/tls.crt", "/etc/tidegate/cert.pem")
            }),
            gw,
            "quic.cert = /etc/tidegate/cert.pem is on no volume",
        ),
        (
            "the key under another name",
            Box::new(|m| {
                edit_gateway_toml(m, "/etc/tidegate/tls/tls.key", "/etc/tidegate/tls/key.pem")
            }),
            gw,
            "has it as tls.key",
        ),
        (
            "the ledger off the claim",
            Box::new(|m| edit_gateway_toml(m, "/var/lib/tidegate/leases.db", "/tmp/leases.db")),
            gw,
            "not a PersistentVolumeClaim",
        ),
        (
            "--config not where the ConfigMap is mounted",
            Box::new(|m| container(m).args.as_mut().unwrap()[1] = "/etc/gateway.toml".into()),
            gw,
            "no volume is mounted where /etc/gateway.toml is",
        ),
        (
            "a gateway.toml that does not validate",
            Box::new(|m| edit_gateway_toml(m, "worker_fps = 900", "worker_fps = 0")),
            gw,
            "worker_fps = 0 must be > 0",
        ),
        (
            "another provider",
            Box::new(|m| edit_gateway_toml(m, "provider = \"kubernetes\"", "provider = \"slurm\"")),
            gw,
            "only used with provider = \"kubernetes\"",
        ),
        (
            "a scrape port that is not the HTTP port",
            Box::new(|m| {
                let t = deployment_spec(m).template.metadata.as_mut().unwrap();
                let a = t.annotations.as_mut().unwrap();
                a.insert("prometheus.io/port".into(), "4433".into());
            }),
            gw,
            "prometheus.io/port",
        ),
        (
            "a rolling update",
            Box::new(|m| {
                deployment_spec(m).strategy.as_mut().unwrap().type_ = Some("RollingUpdate".into())
            }),
            check_deployment,
            "Recreate",
        ),
        (
            "a writable root filesystem",
            Box::new(|m| {
                let sc = container(m).security_context.as_mut().unwrap();
                sc.read_only_root_filesystem = Some(false);
            }),
            check_deployment,
            "readOnlyRootFilesystem",
        ),
        (
            "no time to release the leases",
            Box::new(|m| pod(m).termination_grace_period_seconds = Some(30)),
            check_deployment,
            "terminationGracePeriodSeconds = 30",
        ),
        (
            "workers dialling a Service that does not exist",
            Box::new(|m| {
                edit_gateway_toml(
                    m,
                    "= \"tidegate-gateway.tidegate.svc:4433",
                    "= \"gw.tidegate.svc:4433",
                )
            }),
            workers,
            "names no Service",
        ),
        (
            "workers dialling the HTTP port",
            Box::new(|m| edit_gateway_toml(m, "tidegate.svc:4433", "tidegate.svc:9090")),
            workers,
            "no UDP port Some(9090)",
        ),
        (
            "the CA outside its Secret",
            Box::new(|m| {
                edit_gateway_toml(
                    m,
                    "TIDEGATE_CA = \"/etc/tidegate/ca/",
                    "TIDEGATE_CA = \"/etc/",
                )
            }),
            workers,
            "lies under no Secret",
        ),
        (
            "a worker config that checks another name",
            Box::new(|m| {
                let from = "server_name = \"tidegate-gateway.tidegate.svc\"";
                edit_file(
                    m,
                    "tidegate-worker",
                    "worker.toml",
                    from,
                    "server_name = \"localhost\"",
                );
            }),
            workers,
            "gateway.server_name = Some(\"localhost\")",
        ),
        (
            "the worker ConfigMap missing",
            Box::new(|m| {
                m.config_maps
                    .retain(|c| c.metadata.name.as_deref() != Some("tidegate-worker"))
            }),
            workers,
            "no key of a ConfigMap",
        ),
        (
            "no spot pool",
            Box::new(|m| {
                edit_gateway_toml(
                    m,
                    "[leasing.kubernetes.tiers.spot]",
                    "[leasing.kubernetes.tiers.reserved]",
                )
            }),
            workers,
            "offers no spot",
        ),
    ];
    let mut missed = Vec::new();
    for (case, break_it, check, want) in cases {
        let mut m = manifests();
        break_it(&mut m);
        let problems = check(&m).join("\n");
        if !problems.contains(want) {
            missed.push(format!("{case}: want {want:?} in {problems:?}"));
        }
    }
    assert_ok(missed);
}

#[test]
fn a_mount_of_an_unknown_object_or_a_readme_without_its_command_fails() {
    let readme = readme();
    let mut m = manifests();
    let volumes = pod(&mut m).volumes.as_mut().unwrap();
    let tls = volumes.iter_mut().find(|v| v.name == "tls").unwrap();
    tls.secret.as_mut().unwrap().secret_name = Some("gateway-certs".into());
    let p = check_references(&m, &readme).join("\n");
    assert!(p.contains("Secret \"gateway-certs\", which neither"), "{p}");
    assert!(
        p.contains("\"tidegate-gateway-tls\" is listed as created by command but nothing uses it"),
        "{p}"
    );

    let mut m = manifests();
    m.claims.clear();
    let p = check_references(&m, &readme).join("\n");
    assert!(
        p.contains("PersistentVolumeClaim \"tidegate-ledger\""),
        "{p}"
    );

    let mut m = manifests();
    edit_gateway_toml(
        &mut m,
        "config_map = \"tidegate-worker\"",
        "config_map = \"models\"",
    );
    let p = check_references(&m, &readme).join("\n");
    assert!(p.contains("mounts[1] uses ConfigMap \"models\""), "{p}");

    let without = readme.replace(
        "create secret generic tidegate-ca",
        "create secret generic ca",
    );
    let p = check_references(&manifests(), &without).join("\n");
    assert!(
        p.contains("no `kubectl create secret` command for \"tidegate-ca\""),
        "{p}"
    );
    let without = readme.replace("apply -f rbac.yaml", "apply -f rbac");
    let p = check_references(&manifests(), &without).join("\n");
    assert!(p.contains("`rbac.yaml`"), "{p}");
}
