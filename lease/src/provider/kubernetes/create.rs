//! An acquire's API calls: the token Secret, then the Pod, then the Secret
//! made the Pod's dependent; and, when the API server does not answer in
//! time, the clean-up of what it may have made. It builds nothing (the Pod
//! and Secret come from [`super::config`]) and watches nothing: the
//! provider hands the created Pod to the watch loop.

use std::time::Duration;

use super::super::ProviderError;
use super::{Held, api_error, config, delete_stray, is_status, kube_error};
use crate::catalog::Tier;
use crate::table::LeaseId;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};

/// One acquire's API calls, owning what they need so that they run on the
/// client's runtime.
pub(super) struct PodCreation {
    pub(super) lease: LeaseId,
    pub(super) instance_type: String,
    pub(super) tier: Tier,
    pub(super) pods: Api<Pod>,
    pub(super) secrets: Api<Secret>,
    pub(super) pod: Pod,
    pub(super) secret: Secret,
    pub(super) pod_name: String,
    pub(super) secret_name: String,
}

impl PodCreation {
    /// The token Secret first (the Pod reads it when it starts), then the
    /// Pod, then the Secret made the Pod's dependent.
    pub(super) async fn create(&self) -> Result<Pod, ProviderError> {
        self.create_secret().await?;
        let created = self.create_pod().await?;
        self.give_secret_to(&created).await;
        Ok(created)
    }

    /// Creates the token Secret, replacing one an earlier attempt for this
    /// lease id left.
    async fn create_secret(&self) -> Result<(), ProviderError> {
        let (lease, secrets) = (self.lease, &self.secrets);
        let pp = PostParams::default();
        match secrets.create(&pp, &self.secret).await {
            Ok(_) => Ok(()),
            Err(e) if is_status(&e, 409) => {
                // left by an earlier attempt for this lease id
                secrets
                    .delete(&self.secret_name, &DeleteParams::default())
                    .await
                    .map_err(|e| api_error(Some(lease), "replacing a stale token secret", &e))?;
                secrets
                    .create(&pp, &self.secret)
                    .await
                    .map_err(|e| api_error(Some(lease), "creating its token secret", &e))?;
                Ok(())
            }
            Err(e) => Err(api_error(Some(lease), "creating its token secret", &e)),
        }
    }

    /// Creates the Pod; if that fails, deletes the token Secret and says
    /// why: a quota is no capacity, a name taken is another gateway's.
    async fn create_pod(&self) -> Result<Pod, ProviderError> {
        let (lease, pod_name) = (self.lease, &self.pod_name);
        let e = match self.pods.create(&PostParams::default(), &self.pod).await {
            Ok(p) => return Ok(p),
            Err(e) => e,
        };
        let _ = self
            .secrets
            .delete(&self.secret_name, &DeleteParams::default())
            .await;
        Err(match &e {
            kube::Error::Api(s) if s.is_forbidden() && s.message.contains("quota") => {
                ProviderError::NoCapacity {
                    instance_type: self.instance_type.clone(),
                    tier: self.tier,
                    detail: s.message.clone(),
                }
            }
            kube::Error::Api(s) if s.is_already_exists() => kube_error(
                Some(lease),
                format!("creating pod {pod_name}"),
                format!(
                    "{}; is another gateway using name_prefix in this namespace?",
                    s.message
                ),
            ),
            _ => api_error(Some(lease), format!("creating pod {pod_name}"), &e),
        })
    }

    /// Makes the token Secret a dependent of `created`, so Kubernetes
    /// deletes it with the Pod; a failure is logged (the release deletes
    /// it instead).
    async fn give_secret_to(&self, created: &Pod) {
        let uid = created.metadata.uid.clone().unwrap_or_default();
        let owner = config::owned_by(&self.pod_name, &uid);
        if let Err(e) = self
            .secrets
            .patch(
                &self.secret_name,
                &PatchParams::default(),
                &Patch::Merge(&owner),
            )
            .await
        {
            tracing::warn!(lease = %self.lease, error = %e, "the token secret could not be given to its pod; it is deleted on release instead");
        }
    }

    /// After a creation that did not answer within `limit` (`limit_secs`):
    /// the server may have made the Pod and lost the answer, or may make it
    /// yet, and nothing may run that no lease holds. The watch is told to
    /// delete it if it appears, it is deleted now in case it was made, and
    /// the acquire's error says so.
    pub(super) async fn abandon(
        &self,
        held: &Held,
        limit: Duration,
        limit_secs: f64,
    ) -> ProviderError {
        let (lease, stray_pod, stray_secret) = (self.lease, &self.pod_name, &self.secret_name);
        held.abandon(stray_pod.clone(), stray_secret.clone());
        let cleaned = delete_stray(&self.pods, &self.secrets, stray_pod, stray_secret, limit).await;
        let cleanup = match cleaned {
            Ok(()) => format!(
                "pod {stray_pod} and its token secret deleted in case they were made, and deleted if made later"
            ),
            Err(e) => {
                tracing::warn!(%lease, pod = %stray_pod, error = %e, "a pod whose creation timed out may run: the watch deletes it when it sees it, or the gateway's next start does");
                format!("deleting pod {stray_pod} in case it was made failed too ({e})")
            }
        };
        kube_error(
            Some(lease),
            format!("creating pod {stray_pod}"),
            format!(
                "the API server did not answer within {limit_secs} s (api_timeout_secs); {cleanup}"
            ),
        )
    }
}
