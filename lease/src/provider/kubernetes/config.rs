//! `[leasing.kubernetes]` and the objects built from it: the worker Pod and
//! the Secret holding its one-time lease token. Pure: nothing here talks to
//! the API server.

use std::collections::BTreeMap;
use std::path::PathBuf;

use k8s_openapi::api::core::v1::{
    Capabilities, Container, EnvVar, EnvVarSource, LocalObjectReference, ObjectFieldSelector, Pod,
    PodSecurityContext, PodSpec, ResourceRequirements, SeccompProfile, Secret, SecretKeySelector,
    SecurityContext, Toleration, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use serde::{Deserialize, Serialize};

use super::super::{LeaseSpec, MAX_NOTICE_PERIOD_SECS, ProviderError, checked_secs};
use crate::catalog::{InstanceType, Tier};
use crate::table::LeaseId;

/// Label naming the pool (the `name_prefix`) a worker Pod belongs to; the
/// provider lists and watches its Pods by it.
pub const LABEL_POOL: &str = "tidegate.io/pool";
/// Label carrying the lease id.
pub const LABEL_LEASE: &str = "tidegate.io/lease";
/// Label carrying the tier.
pub const LABEL_TIER: &str = "tidegate.io/tier";
/// Label carrying the catalog instance type.
pub const LABEL_INSTANCE: &str = "tidegate.io/instance-type";
/// Key of the lease token in its Secret.
pub const TOKEN_KEY: &str = "token";
/// Name of the worker container.
pub const CONTAINER: &str = "worker";

/// What the provider asks of the API server: `(API group, resource,
/// verbs)`. The Role in `deploy/kubernetes/` grants at least these (its test
/// checks it).
pub const REQUIRED_PERMISSIONS: &[(&str, &str, &[&str])] = &[
    ("", "pods", &["create", "delete", "get", "list", "watch"]),
    ("", "secrets", &["create", "delete", "list", "patch"]),
];

/// Longest `release_timeout_secs` accepted: an hour.
pub const MAX_RELEASE_TIMEOUT_SECS: f64 = 3600.0;
/// Longest `api_timeout_secs` accepted: ten minutes.
pub const MAX_API_TIMEOUT_SECS: f64 = 600.0;
/// Longest `termination_grace_period_secs` accepted: an hour.
pub const MAX_GRACE_SECS: u32 = 3600;

/// Configuration of the Kubernetes provider (`[leasing.kubernetes]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesConfig {
    /// Namespace of the worker Pods; unset: the kubeconfig context's, or
    /// the gateway's own when it runs in the cluster.
    #[serde(default)]
    pub namespace: Option<String>,
    /// Kubeconfig file; unset: the in-cluster service account, else
    /// `$KUBECONFIG` or `~/.kube/config`.
    #[serde(default)]
    pub kubeconfig: Option<PathBuf>,
    /// Context of the kubeconfig; unset: its current context.
    #[serde(default)]
    pub context: Option<String>,
    /// The worker image (`registry.example.com/tidegate-worker:0.1.0`).
    pub image: String,
    /// `Always`, `IfNotPresent` or `Never`; unset: Kubernetes' default.
    #[serde(default)]
    pub image_pull_policy: Option<String>,
    /// Secrets holding registry credentials for the image.
    #[serde(default)]
    pub image_pull_secrets: Vec<String>,
    /// The container's command; empty: the image's entrypoint.
    #[serde(default)]
    pub command: Vec<String>,
    /// Its arguments.
    #[serde(default)]
    pub args: Vec<String>,
    /// Extra environment for every worker, e.g. `TIDEGATE_GATEWAY_ADDR`
    /// (the gateway's Service, as the Pods reach it) and `TIDEGATE_CA`.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Pods are named `<name_prefix>-<lease id>` and labelled
    /// `tidegate.io/pool=<name_prefix>`; one gateway (one ledger) per
    /// prefix and namespace, since the provider owns every Pod of its pool.
    #[serde(default = "default_prefix")]
    pub name_prefix: String,
    /// The extended resource a GPU is requested as.
    #[serde(default = "default_gpu_resource")]
    pub gpu_resource: String,
    /// GPUs per catalog instance type; a type not listed asks for its
    /// catalog `gpus` (none for a CPU type).
    #[serde(default)]
    pub gpus: BTreeMap<String, u32>,
    /// CPU and memory of every worker (requests = limits).
    #[serde(default)]
    pub resources: WorkerResources,
    /// Node selector of every worker Pod.
    #[serde(default)]
    pub node_selector: BTreeMap<String, String>,
    /// Node selector per catalog instance type (the GPU model's node
    /// label, e.g. `nvidia.com/gpu.product`).
    #[serde(default)]
    pub instance_node_selectors: BTreeMap<String, BTreeMap<String, String>>,
    /// Where each tier's Pods go.
    #[serde(default)]
    pub tiers: KubernetesTiers,
    /// Secrets and ConfigMaps mounted read-only into every worker (the
    /// gateway's CA, models).
    #[serde(default)]
    pub mounts: Vec<Mount>,
    /// Service account of the worker Pods; unset: none is mounted (the
    /// worker needs no API access).
    #[serde(default)]
    pub service_account: Option<String>,
    /// User id the worker runs as; unset: the image's user, which must not
    /// be root (the Pods meet the `restricted` Pod Security Standard:
    /// non-root, no privilege escalation, no capabilities, the runtime's
    /// seccomp profile).
    #[serde(default)]
    pub run_as_user: Option<i64>,
    /// The Pods' `terminationGracePeriodSeconds`: how long a worker has to
    /// drain after SIGTERM, on our release and on a preemption alike.
    #[serde(default = "default_grace")]
    pub termination_grace_period_secs: u32,
    /// Longest `release` waits for a deleted Pod to be gone (s); past it
    /// the release fails, the Pod stays held, and the release is retried.
    #[serde(default = "default_release_timeout_secs")]
    pub release_timeout_secs: f64,
    /// Longest one call to the API server made for an acquire or a release
    /// may take (s): an API server that takes a request and never answers
    /// would otherwise hold the lease up for kube's read timeout; past this
    /// the call fails (an acquire then deletes the Pod it may have made).
    #[serde(default = "default_api_timeout_secs")]
    pub api_timeout_secs: f64,
}

/// `[leasing.kubernetes.resources]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerResources {
    /// CPU (`"4"`, `"3500m"`).
    #[serde(default)]
    pub cpu: Option<String>,
    /// Memory (`"16Gi"`).
    #[serde(default)]
    pub memory: Option<String>,
}

/// `[leasing.kubernetes.tiers]`: the placement of each tier. A tier with
/// no placement is not offered (its acquires are refused as no capacity),
/// except reserved, which falls back to on-demand's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesTiers {
    /// On-demand Pods.
    #[serde(default)]
    pub on_demand: Option<Placement>,
    /// Spot Pods: the spot node pool's selector and toleration.
    #[serde(default)]
    pub spot: Option<Placement>,
    /// Reserved Pods (committed-use nodes); unset: on-demand's placement.
    #[serde(default)]
    pub reserved: Option<Placement>,
}

impl Default for KubernetesTiers {
    fn default() -> KubernetesTiers {
        KubernetesTiers {
            on_demand: Some(Placement::default()),
            spot: None,
            reserved: None,
        }
    }
}

/// Node selector, tolerations and priority of one tier's Pods.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Placement {
    /// Added to the Pod's node selector.
    #[serde(default)]
    pub node_selector: BTreeMap<String, String>,
    /// The Pod's tolerations (a spot pool's taint).
    #[serde(default)]
    pub tolerations: Vec<TolerationConfig>,
    /// The Pod's `priorityClassName`.
    #[serde(default)]
    pub priority_class: Option<String>,
}

/// One toleration, as in a Pod spec.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TolerationConfig {
    /// Taint key; unset with `operator = "Exists"`: every taint.
    #[serde(default)]
    pub key: Option<String>,
    /// `Equal` (default) or `Exists`.
    #[serde(default)]
    pub operator: Option<String>,
    /// Taint value (with `Equal`).
    #[serde(default)]
    pub value: Option<String>,
    /// `NoSchedule`, `PreferNoSchedule` or `NoExecute`; unset: all.
    #[serde(default)]
    pub effect: Option<String>,
}

impl TolerationConfig {
    /// Checks the operator, its key or value, and the effect; `field`
    /// names this toleration in the message.
    fn validate(&self, field: &str) -> Result<(), String> {
        match self.operator.as_deref() {
            None | Some("Equal") => {
                if self.key.is_none() {
                    return Err(format!("{field}: operator Equal needs a key"));
                }
            }
            Some("Exists") => {
                if self.value.is_some() {
                    return Err(format!("{field}: operator Exists takes no value"));
                }
            }
            Some(o) => {
                return Err(format!("{field}: operator {o:?} must be Equal or Exists"));
            }
        }
        if let Some(e) = &self.effect
            && !["NoSchedule", "PreferNoSchedule", "NoExecute"].contains(&e.as_str())
        {
            return Err(format!(
                "{field}: effect {e:?} must be NoSchedule, PreferNoSchedule or NoExecute"
            ));
        }
        Ok(())
    }

    /// As a Pod spec's toleration.
    fn to_toleration(&self) -> Toleration {
        Toleration {
            key: self.key.clone(),
            operator: self.operator.clone(),
            value: self.value.clone(),
            effect: self.effect.clone(),
            toleration_seconds: None,
        }
    }
}

/// A Secret or ConfigMap mounted read-only into every worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mount {
    /// The Secret to mount.
    #[serde(default)]
    pub secret: Option<String>,
    /// The ConfigMap to mount.
    #[serde(default)]
    pub config_map: Option<String>,
    /// Where (an absolute path in the container).
    pub path: String,
}

fn default_prefix() -> String {
    "tidegate-worker".into()
}
fn default_gpu_resource() -> String {
    "nvidia.com/gpu".into()
}
fn default_grace() -> u32 {
    30
}
fn default_release_timeout_secs() -> f64 {
    120.0
}
fn default_api_timeout_secs() -> f64 {
    30.0
}

/// Is `s` a DNS-1123 label (what Kubernetes accepts as a namespace, and
/// within a Pod name)?
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Is `s` a valid label or annotation key (`[prefix/]name`)?
fn is_label_key(s: &str) -> bool {
    let (prefix, name) = match s.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, s),
    };
    let name_ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name.as_bytes()[name.len() - 1].is_ascii_alphanumeric();
    let prefix_ok = prefix.is_none_or(|p| p.len() <= 253 && p.split('.').all(is_dns_label));
    name_ok && prefix_ok
}

/// Is `s` a valid label value (empty, or up to 63 of `[A-Za-z0-9-_.]`
/// starting and ending alphanumeric)?
fn is_label_value(s: &str) -> bool {
    s.is_empty() || (s.len() <= 63 && is_label_key(s) && !s.contains('/'))
}

/// Is `s` an environment variable name Kubernetes accepts?
fn is_env_name(s: &str) -> bool {
    !s.is_empty()
        && !s.as_bytes()[0].is_ascii_digit()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

/// The names of the provider's own variables; the config may not set them.
const RESERVED_ENV: &[&str] = &[
    "TIDEGATE_LEASE_ID",
    "TIDEGATE_LEASE_TOKEN",
    "TIDEGATE_INSTANCE_TYPE",
    "TIDEGATE_GPU_MODEL",
    "TIDEGATE_LEASE_TIER",
    "TIDEGATE_POD_NAME",
];

impl KubernetesConfig {
    /// A config running `image` with on-demand Pods only, everything else
    /// at its default.
    pub fn new(image: impl Into<String>) -> KubernetesConfig {
        KubernetesConfig {
            namespace: None,
            kubeconfig: None,
            context: None,
            image: image.into(),
            image_pull_policy: None,
            image_pull_secrets: Vec::new(),
            command: Vec::new(),
            args: Vec::new(),
            env: BTreeMap::new(),
            name_prefix: default_prefix(),
            gpu_resource: default_gpu_resource(),
            gpus: BTreeMap::new(),
            resources: WorkerResources::default(),
            node_selector: BTreeMap::new(),
            instance_node_selectors: BTreeMap::new(),
            tiers: KubernetesTiers::default(),
            mounts: Vec::new(),
            service_account: None,
            run_as_user: None,
            termination_grace_period_secs: default_grace(),
            release_timeout_secs: default_release_timeout_secs(),
            api_timeout_secs: default_api_timeout_secs(),
        }
    }

    /// Checks what serde cannot (names Kubernetes would refuse, quantities,
    /// ranges) so that a mistake stops the gateway at start, not at the
    /// first acquire; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        self.validate_image_and_names()?;
        self.validate_resources_and_env()?;
        self.validate_node_selectors()?;
        self.validate_placements()?;
        self.validate_mounts_and_identity()?;
        self.validate_timeouts()
    }

    /// The image, its pull policy, and the names the provider builds on:
    /// namespace, name prefix, GPU resource.
    fn validate_image_and_names(&self) -> Result<(), String> {
        if self.image.trim().is_empty() || self.image.contains(char::is_whitespace) {
            return Err(format!(
                "image = {:?} is not an image reference",
                self.image
            ));
        }
        if let Some(ns) = &self.namespace
            && !is_dns_label(ns)
        {
            return Err(format!(
                "namespace = {ns:?} is not a namespace name (lowercase letters, digits, '-')"
            ));
        }
        if let Some(p) = &self.image_pull_policy
            && !["Always", "IfNotPresent", "Never"].contains(&p.as_str())
        {
            return Err(format!(
                "image_pull_policy = {p:?} must be Always, IfNotPresent or Never"
            ));
        }
        // `<prefix>-<u64>-token` must stay a DNS-1123 label (Secret names
        // are subdomains, but labels carry the prefix: 63 at most)
        if !is_dns_label(&self.name_prefix) || self.name_prefix.len() > 36 {
            return Err(format!(
                "name_prefix = {:?} must be a DNS label of at most 36 characters (lowercase letters, digits, '-')",
                self.name_prefix
            ));
        }
        if !is_label_key(&self.gpu_resource) || !self.gpu_resource.contains('/') {
            return Err(format!(
                "gpu_resource = {:?} is not an extended resource name (like nvidia.com/gpu)",
                self.gpu_resource
            ));
        }
        Ok(())
    }

    /// CPU and memory quantities, and the extra environment (whose names
    /// must not be those the provider sets per lease).
    fn validate_resources_and_env(&self) -> Result<(), String> {
        for (field, q) in [
            ("resources.cpu", &self.resources.cpu),
            ("resources.memory", &self.resources.memory),
        ] {
            if let Some(q) = q
                && !is_quantity(q)
            {
                return Err(format!(
                    "{field} = {q:?} is not a Kubernetes quantity (like \"4\", \"500m\", \"16Gi\")"
                ));
            }
        }
        for k in self.env.keys() {
            if !is_env_name(k) {
                return Err(format!("env.{k} is not an environment variable name"));
            }
            if RESERVED_ENV.contains(&k.as_str()) {
                return Err(format!("env.{k} is set by the provider for each lease"));
            }
        }
        Ok(())
    }

    /// Every node selector (the pool's, per instance type, per tier) is
    /// made of node labels.
    fn validate_node_selectors(&self) -> Result<(), String> {
        let selectors = std::iter::once(("node_selector".to_string(), &self.node_selector))
            .chain(
                self.instance_node_selectors
                    .iter()
                    .map(|(t, s)| (format!("instance_node_selectors.{t}"), s)),
            )
            .chain(self.placements().map(|(t, p)| {
                (
                    format!("tiers.{}.node_selector", tier_field(t)),
                    &p.node_selector,
                )
            }));
        for (field, sel) in selectors {
            for (k, v) in sel {
                if !is_label_key(k) || !is_label_value(v) {
                    return Err(format!("{field}: {k:?} = {v:?} is not a node label"));
                }
            }
        }
        Ok(())
    }

    /// Each tier's tolerations and priority class, and that some tier has
    /// a placement at all.
    fn validate_placements(&self) -> Result<(), String> {
        for (tier, p) in self.placements() {
            for (i, t) in p.tolerations.iter().enumerate() {
                let field = format!("tiers.{}.tolerations[{i}]", tier_field(tier));
                t.validate(&field)?;
            }
            if let Some(pc) = &p.priority_class
                && !pc.split('.').all(is_dns_label)
            {
                return Err(format!(
                    "tiers.{}.priority_class = {pc:?} is not a PriorityClass name",
                    tier_field(tier)
                ));
            }
        }
        if self.tiers.on_demand.is_none()
            && self.tiers.spot.is_none()
            && self.tiers.reserved.is_none()
        {
            return Err("tiers: no tier has a placement, so nothing could be leased".into());
        }
        Ok(())
    }

    /// Mounts, the objects named for pulling images and for the Pod's
    /// identity, and its user id.
    fn validate_mounts_and_identity(&self) -> Result<(), String> {
        for (i, m) in self.mounts.iter().enumerate() {
            let source_ok = match (&m.secret, &m.config_map) {
                (Some(n), None) | (None, Some(n)) => n.split('.').all(is_dns_label),
                _ => false,
            };
            if !source_ok {
                return Err(format!(
                    "mounts[{i}] needs exactly one of secret or config_map, naming an object"
                ));
            }
            if !m.path.starts_with('/') || m.path.contains(':') {
                return Err(format!("mounts[{i}].path = {:?} must be absolute", m.path));
            }
        }
        for name in self.image_pull_secrets.iter().chain(&self.service_account) {
            if !name.split('.').all(is_dns_label) {
                return Err(format!("{name:?} is not an object name"));
            }
        }
        if self.run_as_user.is_some_and(|u| u <= 0) {
            return Err(format!(
                "run_as_user = {} must be a non-root user id (> 0)",
                self.run_as_user.unwrap_or_default()
            ));
        }
        Ok(())
    }

    /// The grace period (the notice a preempted Pod gets) and the release
    /// and API timeouts: finite, positive where a zero would wait for
    /// nothing, and within their bounds.
    fn validate_timeouts(&self) -> Result<(), String> {
        if self.termination_grace_period_secs > MAX_GRACE_SECS {
            return Err(format!(
                "termination_grace_period_secs = {} must be at most {MAX_GRACE_SECS}",
                self.termination_grace_period_secs
            ));
        }
        let t = self.release_timeout_secs;
        checked_secs("release_timeout_secs", t, MAX_RELEASE_TIMEOUT_SECS)?;
        if t <= 0.0 {
            return Err(format!("release_timeout_secs = {t} must be > 0"));
        }
        let t = self.api_timeout_secs;
        checked_secs("api_timeout_secs", t, MAX_API_TIMEOUT_SECS)?;
        if t <= 0.0 {
            return Err(format!("api_timeout_secs = {t} must be > 0"));
        }
        // the notice a preempted Pod gets is its grace period
        checked_secs(
            "termination_grace_period_secs",
            f64::from(self.termination_grace_period_secs),
            MAX_NOTICE_PERIOD_SECS,
        )?;
        Ok(())
    }

    fn placements(&self) -> impl Iterator<Item = (Tier, &Placement)> {
        [
            (Tier::OnDemand, self.tiers.on_demand.as_ref()),
            (Tier::Spot, self.tiers.spot.as_ref()),
            (Tier::Reserved, self.tiers.reserved.as_ref()),
        ]
        .into_iter()
        .filter_map(|(t, p)| p.map(|p| (t, p)))
    }

    /// The placement of `tier`, or `None` when the tier is not offered.
    pub fn placement(&self, tier: Tier) -> Option<&Placement> {
        match tier {
            Tier::OnDemand => self.tiers.on_demand.as_ref(),
            Tier::Spot => self.tiers.spot.as_ref(),
            Tier::Reserved => self
                .tiers
                .reserved
                .as_ref()
                .or(self.tiers.on_demand.as_ref()),
        }
    }

    /// GPUs a Pod of `instance` asks for.
    pub fn gpus_for(&self, instance: &InstanceType) -> u32 {
        self.gpus
            .get(&instance.name)
            .copied()
            .unwrap_or(instance.gpus)
    }

    /// The worker Pod of a lease.
    pub fn pod_name(&self, lease: LeaseId) -> String {
        format!("{}-{}", self.name_prefix, lease.0)
    }

    /// The Secret holding a lease's token.
    pub fn secret_name(&self, lease: LeaseId) -> String {
        format!("{}-{}-token", self.name_prefix, lease.0)
    }

    /// The label selector of this provider's Pods and Secrets.
    pub fn selector(&self) -> String {
        format!("{LABEL_POOL}={}", self.name_prefix)
    }

    fn labels(&self, spec: &LeaseSpec) -> BTreeMap<String, String> {
        let mut l = BTreeMap::new();
        l.insert("app.kubernetes.io/name".into(), "tidegate-worker".into());
        l.insert(
            "app.kubernetes.io/managed-by".into(),
            "tidegate-gateway".into(),
        );
        l.insert(LABEL_POOL.into(), self.name_prefix.clone());
        l.insert(LABEL_LEASE.into(), spec.lease.0.to_string());
        l.insert(LABEL_TIER.into(), spec.tier.as_str().to_string());
        if is_label_value(&spec.instance.name) {
            l.insert(LABEL_INSTANCE.into(), spec.instance.name.clone());
        }
        l
    }

    /// The Secret holding the lease's one-time token. The Pod reads it
    /// through `secretKeyRef`, so the token is on no command line and in no
    /// Pod spec; once the Pod exists the Secret is made its dependent
    /// ([`owned_by`]), so it goes with the Pod even if the gateway is down.
    pub fn token_secret(&self, spec: &LeaseSpec, namespace: &str) -> Secret {
        let mut data = BTreeMap::new();
        data.insert(TOKEN_KEY.to_string(), spec.token.expose().to_string());
        Secret {
            metadata: ObjectMeta {
                name: Some(self.secret_name(spec.lease)),
                namespace: Some(namespace.to_string()),
                labels: Some(self.labels(spec)),
                ..ObjectMeta::default()
            },
            string_data: Some(data),
            type_: Some("Opaque".into()),
            immutable: Some(true),
            ..Secret::default()
        }
    }

    /// The worker Pod of a lease, or why the lease cannot have one.
    pub fn pod(&self, spec: &LeaseSpec, namespace: &str) -> Result<Pod, ProviderError> {
        let placement = self
            .placement(spec.tier)
            .ok_or_else(|| ProviderError::NoCapacity {
                instance_type: spec.instance.name.clone(),
                tier: spec.tier,
                detail: format!(
                    "[leasing.kubernetes.tiers.{}] is not configured",
                    tier_field(spec.tier)
                ),
            })?;
        let (volumes, mounts) = self.volumes();
        let container = self.worker_container(spec, mounts);
        let selector = self.node_selector_for(spec, placement);
        let tolerations: Vec<Toleration> = placement
            .tolerations
            .iter()
            .map(TolerationConfig::to_toleration)
            .collect();
        Ok(Pod {
            metadata: ObjectMeta {
                name: Some(self.pod_name(spec.lease)),
                namespace: Some(namespace.to_string()),
                labels: Some(self.labels(spec)),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                containers: vec![container],
                // a lease is one run of a worker: a crash ends it
                restart_policy: Some("Never".into()),
                termination_grace_period_seconds: Some(i64::from(
                    self.termination_grace_period_secs,
                )),
                node_selector: (!selector.is_empty()).then_some(selector),
                tolerations: (!tolerations.is_empty()).then_some(tolerations),
                priority_class_name: placement.priority_class.clone(),
                service_account_name: self.service_account.clone(),
                automount_service_account_token: Some(self.service_account.is_some()),
                image_pull_secrets: (!self.image_pull_secrets.is_empty()).then(|| {
                    self.image_pull_secrets
                        .iter()
                        .map(|s| LocalObjectReference { name: s.clone() })
                        .collect()
                }),
                volumes: (!volumes.is_empty()).then_some(volumes),
                security_context: Some(PodSecurityContext {
                    run_as_non_root: Some(true),
                    run_as_user: self.run_as_user,
                    seccomp_profile: Some(SeccompProfile {
                        type_: "RuntimeDefault".into(),
                        localhost_profile: None,
                    }),
                    ..PodSecurityContext::default()
                }),
                ..PodSpec::default()
            }),
            status: None,
        })
    }

    /// The worker's container: its image and command, the lease's
    /// environment, its resource limits and `mounts`, no privileges.
    fn worker_container(&self, spec: &LeaseSpec, mounts: Vec<VolumeMount>) -> Container {
        let limits = self.limits(spec);
        Container {
            name: CONTAINER.into(),
            image: Some(self.image.clone()),
            image_pull_policy: self.image_pull_policy.clone(),
            command: (!self.command.is_empty()).then(|| self.command.clone()),
            args: (!self.args.is_empty()).then(|| self.args.clone()),
            env: Some(self.worker_env(spec)),
            resources: (!limits.is_empty()).then(|| ResourceRequirements {
                // requests default to the limits
                limits: Some(limits),
                ..ResourceRequirements::default()
            }),
            volume_mounts: (!mounts.is_empty()).then_some(mounts),
            security_context: Some(SecurityContext {
                allow_privilege_escalation: Some(false),
                capabilities: Some(Capabilities {
                    drop: Some(vec!["ALL".into()]),
                    add: None,
                }),
                ..SecurityContext::default()
            }),
            ..Container::default()
        }
    }

    /// The worker's environment: the configured one, then the lease's
    /// identity, its token (read from the lease's Secret, never written
    /// into the spec), its type and tier, and the Pod's own name.
    fn worker_env(&self, spec: &LeaseSpec) -> Vec<EnvVar> {
        let plain = |name: &str, value: String| EnvVar {
            name: name.to_string(),
            value: Some(value),
            value_from: None,
        };
        let mut env: Vec<EnvVar> = self.env.iter().map(|(k, v)| plain(k, v.clone())).collect();
        env.extend([
            plain("TIDEGATE_LEASE_ID", spec.lease.0.to_string()),
            EnvVar {
                name: "TIDEGATE_LEASE_TOKEN".into(),
                value: None,
                value_from: Some(EnvVarSource {
                    secret_key_ref: Some(SecretKeySelector {
                        name: self.secret_name(spec.lease),
                        key: TOKEN_KEY.into(),
                        optional: Some(false),
                    }),
                    ..EnvVarSource::default()
                }),
            },
            plain("TIDEGATE_INSTANCE_TYPE", spec.instance.name.clone()),
            plain("TIDEGATE_GPU_MODEL", spec.instance.gpu_model.clone()),
            plain("TIDEGATE_LEASE_TIER", spec.tier.as_str().to_string()),
            EnvVar {
                name: "TIDEGATE_POD_NAME".into(),
                value: None,
                value_from: Some(EnvVarSource {
                    field_ref: Some(ObjectFieldSelector {
                        api_version: None,
                        field_path: "metadata.name".into(),
                    }),
                    ..EnvVarSource::default()
                }),
            },
        ]);
        env
    }

    /// The container's limits: the instance type's GPUs (none for a CPU
    /// type), and the configured CPU and memory.
    fn limits(&self, spec: &LeaseSpec) -> BTreeMap<String, Quantity> {
        let mut limits = BTreeMap::new();
        let gpus = self.gpus_for(&spec.instance);
        if gpus > 0 {
            limits.insert(self.gpu_resource.clone(), Quantity(gpus.to_string()));
        }
        if let Some(c) = &self.resources.cpu {
            limits.insert("cpu".into(), Quantity(c.clone()));
        }
        if let Some(m) = &self.resources.memory {
            limits.insert("memory".into(), Quantity(m.clone()));
        }
        limits
    }

    /// The Pod's node selector: the pool's, then the instance type's, then
    /// the tier's; a later one wins on the same label.
    fn node_selector_for(
        &self,
        spec: &LeaseSpec,
        placement: &Placement,
    ) -> BTreeMap<String, String> {
        let mut selector = self.node_selector.clone();
        if let Some(s) = self.instance_node_selectors.get(&spec.instance.name) {
            selector.extend(s.clone());
        }
        selector.extend(placement.node_selector.clone());
        selector
    }

    /// The configured mounts, read-only: the Pod's volumes and the
    /// container's mounts of them (`mount-<i>`).
    fn volumes(&self) -> (Vec<Volume>, Vec<VolumeMount>) {
        self.mounts
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let name = format!("mount-{i}");
                let volume = Volume {
                    name: name.clone(),
                    secret: m.secret.as_ref().map(|s| {
                        k8s_openapi::api::core::v1::SecretVolumeSource {
                            secret_name: Some(s.clone()),
                            ..Default::default()
                        }
                    }),
                    config_map: m.config_map.as_ref().map(|c| {
                        k8s_openapi::api::core::v1::ConfigMapVolumeSource {
                            name: c.clone(),
                            ..Default::default()
                        }
                    }),
                    ..Volume::default()
                };
                let mount = VolumeMount {
                    name,
                    mount_path: m.path.clone(),
                    read_only: Some(true),
                    ..VolumeMount::default()
                };
                (volume, mount)
            })
            .unzip()
    }
}

/// The merge patch that makes a token Secret a dependent of its Pod (so the
/// garbage collector deletes it with the Pod).
pub fn owned_by(pod_name: &str, pod_uid: &str) -> serde_json::Value {
    let owner = OwnerReference {
        api_version: "v1".into(),
        kind: "Pod".into(),
        name: pod_name.into(),
        uid: pod_uid.into(),
        controller: Some(false),
        block_owner_deletion: Some(false),
    };
    serde_json::json!({ "metadata": { "ownerReferences": [owner] } })
}

/// The `[leasing.kubernetes.tiers.*]` key of a tier.
pub fn tier_field(tier: Tier) -> &'static str {
    match tier {
        Tier::OnDemand => "on_demand",
        Tier::Spot => "spot",
        Tier::Reserved => "reserved",
    }
}

/// Is `s` a Kubernetes resource quantity (`4`, `0.5`, `500m`, `16Gi`,
/// `1e3`)?
pub fn is_quantity(s: &str) -> bool {
    let digits_end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(digits_end);
    let number = number.strip_prefix('+').unwrap_or(number);
    let number_ok = !number.is_empty()
        && number.chars().filter(|c| *c == '.').count() <= 1
        && number.chars().any(|c| c.is_ascii_digit())
        && !number.contains('+');
    let suffix_ok = matches!(
        suffix,
        "" | "m" | "k" | "M" | "G" | "T" | "P" | "E" | "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei"
    ) || suffix.strip_prefix(['e', 'E']).is_some_and(|e| {
        let e = e.strip_prefix(['+', '-']).unwrap_or(e);
        !e.is_empty() && e.bytes().all(|b| b.is_ascii_digit())
    });
    number_ok && suffix_ok
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::Catalog;
    use crate::table::LeaseToken;

    fn spec(tier: Tier, instance: &str) -> LeaseSpec {
        LeaseSpec {
            lease: LeaseId(42),
            token: LeaseToken::generate().unwrap(),
            instance: Catalog::default_catalog().get(instance).unwrap().clone(),
            tier,
            preempt_after: None,
        }
    }

    fn spot_config() -> KubernetesConfig {
        let mut c = KubernetesConfig::new("registry.example.com/tidegate-worker:0.1.0");
        c.tiers.spot = Some(Placement {
            node_selector: [("cloud.google.com/gke-spot".to_string(), "true".to_string())].into(),
            tolerations: vec![TolerationConfig {
                key: Some("cloud.google.com/gke-spot".into()),
                operator: Some("Equal".into()),
                value: Some("true".into()),
                effect: Some("NoSchedule".into()),
            }],
            priority_class: Some("tidegate-spot".into()),
        });
        c.instance_node_selectors.insert(
            "h100".into(),
            [(
                "nvidia.com/gpu.product".to_string(),
                "NVIDIA-H100-80GB-HBM3".to_string(),
            )]
            .into(),
        );
        c.env.insert(
            "TIDEGATE_GATEWAY_ADDR".into(),
            "gw.tidegate.svc:4433".into(),
        );
        c.mounts.push(Mount {
            secret: Some("tidegate-ca".into()),
            config_map: None,
            path: "/etc/tidegate/ca".into(),
        });
        c.resources.memory = Some("16Gi".into());
        c
    }

    #[test]
    fn a_spot_pod_asks_for_its_gpus_on_the_spot_pool_and_reads_its_token_from_a_secret() {
        let cfg = spot_config();
        cfg.validate().unwrap();
        let s = spec(Tier::Spot, "h100");
        let pod = cfg.pod(&s, "tidegate").unwrap();
        assert_eq!(pod.metadata.name.as_deref(), Some("tidegate-worker-42"));
        let labels = pod.metadata.labels.as_ref().unwrap();
        assert_eq!(labels[LABEL_POOL], "tidegate-worker");
        assert_eq!(labels[LABEL_LEASE], "42");
        assert_eq!(labels[LABEL_TIER], "spot");
        let spec_ = pod.spec.as_ref().unwrap();
        assert_eq!(spec_.restart_policy.as_deref(), Some("Never"));
        assert_eq!(spec_.termination_grace_period_seconds, Some(30));
        let sel = spec_.node_selector.as_ref().unwrap();
        assert_eq!(sel["cloud.google.com/gke-spot"], "true");
        assert_eq!(sel["nvidia.com/gpu.product"], "NVIDIA-H100-80GB-HBM3");
        let tol = &spec_.tolerations.as_ref().unwrap()[0];
        assert_eq!(tol.key.as_deref(), Some("cloud.google.com/gke-spot"));
        assert_eq!(spec_.priority_class_name.as_deref(), Some("tidegate-spot"));
        assert_eq!(spec_.automount_service_account_token, Some(false));
        // the restricted Pod Security Standard
        let psc = spec_.security_context.as_ref().unwrap();
        assert_eq!(psc.run_as_non_root, Some(true));
        assert_eq!(
            psc.seccomp_profile.as_ref().unwrap().type_,
            "RuntimeDefault"
        );
        let csc = spec_.containers[0].security_context.as_ref().unwrap();
        assert_eq!(csc.allow_privilege_escalation, Some(false));
        assert_eq!(
            csc.capabilities.as_ref().unwrap().drop.as_deref(),
            Some(&["ALL".to_string()][..])
        );
        let c = &spec_.containers[0];
        let limits = c.resources.as_ref().unwrap().limits.as_ref().unwrap();
        let gpus = Catalog::default_catalog().get("h100").unwrap().gpus;
        assert_eq!(limits["nvidia.com/gpu"].0, gpus.to_string());
        assert_eq!(limits["memory"].0, "16Gi");
        let env = c.env.as_ref().unwrap();
        let token = env
            .iter()
            .find(|e| e.name == "TIDEGATE_LEASE_TOKEN")
            .unwrap();
        assert_eq!(token.value, None, "the token is not in the Pod spec");
        let r = token
            .value_from
            .as_ref()
            .unwrap()
            .secret_key_ref
            .as_ref()
            .unwrap();
        assert_eq!(r.name, "tidegate-worker-42-token");
        assert_eq!(r.key, TOKEN_KEY);
        let json = serde_json::to_string(&pod).unwrap();
        assert!(!json.contains(s.token.expose()), "{json}");
        assert!(env.iter().any(|e| e.name == "TIDEGATE_GATEWAY_ADDR"));
        assert_eq!(
            c.volume_mounts.as_ref().unwrap()[0].mount_path,
            "/etc/tidegate/ca"
        );
        let secret = cfg.token_secret(&s, "tidegate");
        assert_eq!(
            secret.string_data.as_ref().unwrap()[TOKEN_KEY],
            s.token.expose()
        );
        assert_eq!(
            secret.metadata.labels.as_ref().unwrap()[LABEL_POOL],
            "tidegate-worker"
        );
    }

    #[test]
    fn tiers_without_a_placement_are_refused_and_reserved_falls_back_to_on_demand() {
        let cfg = KubernetesConfig::new("img");
        let e = cfg.pod(&spec(Tier::Spot, "h100"), "ns").unwrap_err();
        assert!(
            matches!(
                e,
                ProviderError::NoCapacity {
                    tier: Tier::Spot,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("tiers.spot"), "{e}");
        let pod = cfg.pod(&spec(Tier::Reserved, "h100"), "ns").unwrap();
        assert_eq!(pod.spec.unwrap().node_selector, None);
    }

    #[test]
    fn a_cpu_type_asks_for_no_gpu_and_the_gpus_map_overrides_the_catalog() {
        let mut cfg = KubernetesConfig::new("img");
        let pod = cfg.pod(&spec(Tier::OnDemand, "cpu-32"), "ns").unwrap();
        assert!(pod.spec.unwrap().containers[0].resources.is_none());
        cfg.gpus.insert("h100".into(), 8);
        let pod = cfg.pod(&spec(Tier::OnDemand, "h100"), "ns").unwrap();
        let c = &pod.spec.unwrap().containers[0];
        assert_eq!(
            c.resources.as_ref().unwrap().limits.as_ref().unwrap()["nvidia.com/gpu"].0,
            "8"
        );
    }

    #[test]
    fn validation_names_the_field_and_what_is_wrong() {
        let bad = |f: &dyn Fn(&mut KubernetesConfig), want: &str| {
            let mut c = spot_config();
            f(&mut c);
            let e = c.validate().unwrap_err();
            assert!(e.contains(want), "{want:?} not in {e:?}");
        };
        bad(&|c| c.image = " ".into(), "image");
        bad(&|c| c.namespace = Some("Tidegate".into()), "namespace");
        bad(
            &|c| c.image_pull_policy = Some("always".into()),
            "image_pull_policy",
        );
        bad(&|c| c.name_prefix = "Worker".into(), "name_prefix");
        bad(&|c| c.name_prefix = "w".repeat(37), "name_prefix");
        bad(&|c| c.gpu_resource = "gpu".into(), "gpu_resource");
        bad(&|c| c.resources.cpu = Some("four".into()), "resources.cpu");
        bad(
            &|c| {
                c.env.insert("TIDEGATE_LEASE_TOKEN".into(), "x".into());
            },
            "env.TIDEGATE_LEASE_TOKEN",
        );
        bad(
            &|c| {
                c.env.insert("1X".into(), "x".into());
            },
            "env.1X",
        );
        bad(
            &|c| {
                c.node_selector.insert("a b".into(), "x".into());
            },
            "node_selector",
        );
        bad(
            &|c| c.tiers.spot.as_mut().unwrap().tolerations[0].operator = Some("In".into()),
            "tiers.spot.tolerations[0]",
        );
        bad(
            &|c| c.tiers.spot.as_mut().unwrap().tolerations[0].effect = Some("Evict".into()),
            "effect",
        );
        bad(
            &|c| {
                c.tiers = KubernetesTiers {
                    on_demand: None,
                    spot: None,
                    reserved: None,
                }
            },
            "no tier",
        );
        bad(&|c| c.mounts[0].config_map = Some("m".into()), "mounts[0]");
        bad(&|c| c.mounts[0].path = "etc".into(), "mounts[0].path");
        bad(
            &|c| c.termination_grace_period_secs = 7200,
            "termination_grace",
        );
        bad(&|c| c.run_as_user = Some(0), "run_as_user");
        bad(&|c| c.release_timeout_secs = 0.0, "release_timeout_secs");
        bad(
            &|c| c.release_timeout_secs = f64::NAN,
            "release_timeout_secs",
        );
        bad(&|c| c.api_timeout_secs = 0.0, "api_timeout_secs");
        bad(&|c| c.api_timeout_secs = -1.0, "api_timeout_secs");
        bad(&|c| c.api_timeout_secs = f64::NAN, "api_timeout_secs");
        bad(&|c| c.api_timeout_secs = 601.0, "api_timeout_secs");
    }

    #[test]
    fn quantities_parse_like_kubernetes() {
        for ok in ["4", "0.5", "500m", "16Gi", "1e3", "1E-2", "+2", "128974848"] {
            assert!(is_quantity(ok), "{ok}");
        }
        for bad in ["", "four", "1.2.3", "Gi", "4 Gi", "-1", "1gi", "1e"] {
            assert!(!is_quantity(bad), "{bad}");
        }
    }

    #[test]
    fn the_owner_patch_names_the_pod() {
        let p = owned_by("tidegate-worker-1", "uid-1");
        let o = &p["metadata"]["ownerReferences"][0];
        assert_eq!(o["kind"], "Pod");
        assert_eq!(o["uid"], "uid-1");
        assert_eq!(o["apiVersion"], "v1");
    }

    #[test]
    fn a_config_reads_from_toml_with_defaults() {
        let c: KubernetesConfig =
            toml::from_str("image = \"w:1\"\n[tiers.spot]\nnode_selector = { pool = \"spot\" }\n")
                .unwrap();
        c.validate().unwrap();
        assert_eq!(c.name_prefix, "tidegate-worker");
        assert_eq!(c.gpu_resource, "nvidia.com/gpu");
        // a tiers table without on_demand offers no on-demand leases
        assert!(c.placement(Tier::OnDemand).is_none());
        assert!(c.placement(Tier::Spot).is_some());
        let e = toml::from_str::<KubernetesConfig>("image = \"w\"\nimage_pul_policy = \"x\"\n")
            .unwrap_err();
        assert!(e.to_string().contains("image_pul_policy"), "{e}");
    }
}
