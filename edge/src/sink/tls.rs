//! The TLS client of the result sinks that speak TLS (an `https://` webhook,
//! an `mqtts://` broker): rustls with ring, the stack the edge's QUIC uplink
//! already links, trusting a configured CA file or else the system's roots.

use std::path::Path;
use std::sync::Arc;

use tokio_rustls::rustls;

/// A client configuration trusting the PEM certificates in `ca`, or the
/// system's roots. The error says what is wrong, naming the file.
pub fn client_config(ca: Option<&Path>) -> Result<rustls::ClientConfig, String> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    match ca {
        Some(path) => {
            let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
                .and_then(|it| it.collect())
                .map_err(|e| format!("reading {}: {e}", path.display()))?;
            if certs.is_empty() {
                return Err(format!("{} holds no PEM certificate", path.display()));
            }
            for c in certs {
                roots
                    .add(c)
                    .map_err(|e| format!("{}: {e}", path.display()))?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                return Err(format!(
                    "no trusted root certificates on this system ({} errors reading them); install ca-certificates or configure a CA file",
                    found.errors.len()
                ));
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth())
}
