//! Development TLS material: a throw-away CA and a server certificate for
//! `localhost`/`127.0.0.1`, generated on demand and never committed.

use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};

/// Why dev certificates could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CertError {
    /// Key or certificate generation failed.
    #[error("generating certificates: {0}")]
    Generate(#[from] rcgen::Error),
    /// Writing a file failed.
    #[error("writing {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// Paths of the files [`generate`] writes.
#[derive(Debug, Clone)]
pub struct DevCerts {
    /// The CA certificate edges and workers trust.
    pub ca_cert: PathBuf,
    /// The gateway's certificate chain (server certificate then CA).
    pub server_cert: PathBuf,
    /// The gateway's private key.
    pub server_key: PathBuf,
}

impl DevCerts {
    /// The file names used inside `dir`.
    pub fn in_dir(dir: &Path) -> Self {
        DevCerts {
            ca_cert: dir.join("ca.pem"),
            server_cert: dir.join("gateway.pem"),
            server_key: dir.join("gateway.key"),
        }
    }
}

/// Writes a new CA and a server certificate for `names` (DNS names or IP
/// addresses) into `dir`. Existing files are replaced.
pub fn generate(dir: &Path, names: &[String]) -> Result<DevCerts, CertError> {
    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "tidegate development CA");
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = Issuer::from_params(&ca, &ca_key);

    let key = KeyPair::generate()?;
    let mut server = CertificateParams::new(names.to_vec())?;
    server
        .distinguished_name
        .push(DnType::CommonName, "tidegate gateway");
    let server_cert = server.signed_by(&key, &issuer)?;

    let out = DevCerts::in_dir(dir);
    let write = |path: &Path, text: String| {
        std::fs::create_dir_all(dir)
            .and_then(|_| std::fs::write(path, text))
            .map_err(|source| CertError::Write {
                path: path.to_path_buf(),
                source,
            })
    };
    write(&out.ca_cert, ca_cert.pem())?;
    write(
        &out.server_cert,
        format!("{}{}", server_cert.pem(), ca_cert.pem()),
    )?;
    write(&out.server_key, key.serialize_pem())?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&out.server_key, std::fs::Permissions::from_mode(0o600));
    }
    Ok(out)
}

#[cfg(all(test, feature = "quic"))]
mod tests {
    use super::*;

    #[test]
    fn generated_certs_load_as_quic_server_and_client_configs() {
        let dir = tempfile::tempdir().unwrap();
        let c = generate(dir.path(), &["localhost".into(), "127.0.0.1".into()]).unwrap();
        crate::quic::server_config(&c.server_cert, &c.server_key).unwrap();
        crate::quic::client_config(&c.ca_cert).unwrap();
    }
}
