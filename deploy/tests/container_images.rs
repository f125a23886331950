//! The container images of `scripts/image.py` (`make images`), built from
//! this workspace's binaries and taken apart as a container runtime would:
//!
//! - each archive is an OCI image layout in a tar (`oci-archive:`):
//!   `oci-layout`; `index.json` naming the image as deploy/kubernetes/ does;
//!   its manifest, config and gzip'd layers, each blob's sha256 and size
//!   those of its descriptor and each layer's uncompressed sha256 the
//!   config's `diff_ids`; no stray file; docker-archive's `manifest.json`
//!   naming the same blobs. Every path in every tar is relative and stays
//!   inside the root; the binaries carry no DWARF (stripped);
//! - two builds of the same binaries are the same bytes;
//! - each image's user, entrypoint, arguments, ports and paths agree with
//!   deploy/kubernetes/: the gateway's Deployment, the worker Pods of
//!   `[leasing.kubernetes]` and worker.yaml's `worker.toml`;
//! - run under `chroot` as the image's user, each from its own unpacked
//!   layers (as root only; elsewhere the test says it skipped, and fails
//!   when `CI` is set): the gateway, with gateway.yaml's `gateway.toml` on
//!   free ports and the `static` lease provider in place of Kubernetes,
//!   writes nothing but its ledger volume and /tmp (its root filesystem is
//!   read-only in the cluster); the worker, with worker.yaml's
//!   `worker.toml` on the CPU, finds the gateway by its Service name through
//!   its own glibc and /etc/hosts, registers, is bound to a lease, and
//!   answers BlazeFace frames sent by `tidegate-loadtest`. What a runtime
//!   or the kubelet adds, the test adds: the mounted files, /etc/hosts, and
//!   /dev/{null,zero,random,urandom}. It mounts no /proc, so ONNX Runtime
//!   logs that it cannot read /proc/cpuinfo, and runs on;
//! - the CUDA worker's image (`--only worker-cuda`, what deploy/kubernetes/
//!   leases) holds a worker built with the `cuda` feature, ONNX Runtime's
//!   CUDA provider, what that provider and the GPU preprocessing load by
//!   name on its `LD_LIBRARY_PATH`, the NVIDIA licences and no driver
//!   library; under `chroot` its own loader finds everything its libraries
//!   and the worker link to but the driver's `libcuda.so.1`, and the worker
//!   finds its CUDA provider and compiles its kernel with NVRTC there
//!   (`check-cuda`), refuses to start without a driver, and with
//!   `fallback = "cpu"` runs its models on the CPU.
//!
//! The last test breaks copies of an archive and of the images to show that
//! each check can fail.
//!
//! The binaries are the workspace's, built before these tests run
//! (`make test`, or `cargo build --workspace --bins --all-features`), found
//! by [`tidegate_deploy::bin_dir`]: this crate has none of its own.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use serde::Deserialize;
use serde_json::Value;
use sha2::{Digest, Sha256};
use tidegate_deploy::{assert_ok, bin, bin_dir, workspace_root};

/// Longest any one wait of these tests lasts.
const WAIT: Duration = Duration::from_secs(60);

// ----------------------------------------------------------------- building

/// The archives of one `scripts/image.py` run.
#[derive(Debug)]
struct Archives {
    gateway: PathBuf,
    worker: PathBuf,
}

/// Starts `scripts/image.py` on [`bin_dir`]'s binaries, writing into `out`
/// (`--only` one image, or both).
fn start_build(out: &Path, only: Option<&str>) -> Child {
    start_build_with(out, only, &[])
}

/// [`start_build`] with more arguments for image.py.
fn start_build_with(out: &Path, only: Option<&str>, more: &[&str]) -> Child {
    bin("tidegate-gateway");
    bin("tidegate-worker");
    let mut cmd = Command::new("python3");
    cmd.arg(workspace_root().join("scripts/image.py"))
        .arg("--bin-dir")
        .arg(bin_dir())
        .arg("--out")
        .arg(out)
        .env_remove("SOURCE_DATE_EPOCH")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(only) = only {
        cmd.args(["--only", only]);
    }
    cmd.args(more);
    cmd.spawn()
        .expect("python3 runs scripts/image.py (make setup installs python3)")
}

/// Waits for a [`start_build`], which must succeed.
fn finish_build(build: Child, out: &Path) -> Archives {
    let o = build
        .wait_with_output()
        .expect("waiting for scripts/image.py");
    assert!(
        o.status.success(),
        "scripts/image.py failed ({}):\n{}{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let version = env!("CARGO_PKG_VERSION");
    Archives {
        gateway: out.join(format!("tidegate-gateway-{version}.oci.tar")),
        worker: out.join(format!("tidegate-worker-{version}.oci.tar")),
    }
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn sha256_hex(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

// ---------------------------------------------------------------------- tar

/// One entry of a ustar archive (what image.py writes).
#[derive(Debug, Clone)]
struct TarEntry {
    /// Relative, without a trailing `/`.
    path: String,
    /// `b'0'` file, `b'5'` directory, `b'2'` symlink, ...
    kind: u8,
    mode: u32,
    uid: u32,
    gid: u32,
    /// A symlink's target.
    link: String,
    data: Vec<u8>,
}

/// The entries of a ustar archive. Each header's checksum is checked, and
/// each path must be relative and stay inside the root.
fn read_tar(bytes: &[u8]) -> Result<Vec<TarEntry>, String> {
    let mut entries = Vec::new();
    let mut at = 0;
    loop {
        let header = bytes
            .get(at..at + 512)
            .ok_or_else(|| format!("the archive ends inside a header, at byte {at}"))?;
        if header.iter().all(|&b| b == 0) {
            return Ok(entries);
        }
        let text = |from: usize, len: usize| {
            let f = &header[from..from + len];
            let end = f.iter().position(|&b| b == 0).unwrap_or(len);
            String::from_utf8_lossy(&f[..end]).into_owned()
        };
        let number = |from: usize, len: usize| {
            let s = text(from, len);
            u32::from_str_radix(s.trim(), 8)
                .map_err(|_| format!("header at byte {at}: {s:?} is not an octal number"))
        };
        if &header[257..263] != b"ustar\0" {
            return Err(format!("the header at byte {at} is not ustar"));
        }
        let sum: u32 = header
            .iter()
            .enumerate()
            .map(|(i, &b)| {
                if (148..156).contains(&i) {
                    32
                } else {
                    u32::from(b)
                }
            })
            .sum();
        if number(148, 8)? != sum {
            return Err(format!("the header at byte {at} fails its checksum"));
        }
        let (prefix, name) = (text(345, 155), text(0, 100));
        let path = if prefix.is_empty() {
            name
        } else {
            format!("{prefix}/{name}")
        };
        let path = path.strip_suffix('/').unwrap_or(&path).to_string();
        if path.starts_with('/') || path.split('/').any(|c| matches!(c, "" | "." | "..")) {
            return Err(format!("entry {path:?} is absolute or leaves the root"));
        }
        let size = number(124, 12)? as usize;
        let start = at + 512;
        let data = bytes
            .get(start..start + size)
            .ok_or_else(|| format!("{path}: the archive ends inside its {size} bytes"))?;
        entries.push(TarEntry {
            kind: header[156],
            mode: number(100, 8)?,
            uid: number(108, 8)?,
            gid: number(116, 8)?,
            link: text(157, 100),
            data: data.to_vec(),
            path,
        });
        at = start + size.div_ceil(512) * 512;
    }
}

/// Unpacks `layers` in order into `root`, with their modes and owners.
fn unpack(layers: &[Vec<TarEntry>], root: &Path) -> Result<(), String> {
    for e in layers.iter().flatten() {
        let dest = root.join(&e.path);
        let io = |what: &str, err: std::io::Error| format!("{what} {}: {err}", dest.display());
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent).map_err(|err| io("creating", err))?;
        }
        if e.kind != b'5' && dest.symlink_metadata().is_ok() {
            std::fs::remove_file(&dest).map_err(|err| io("replacing", err))?;
        }
        match e.kind {
            b'5' => std::fs::create_dir_all(&dest).map_err(|err| io("creating", err))?,
            b'0' | 0 => std::fs::write(&dest, &e.data).map_err(|err| io("writing", err))?,
            b'2' => {
                std::os::unix::fs::symlink(&e.link, &dest).map_err(|err| io("linking", err))?;
                std::os::unix::fs::lchown(&dest, Some(e.uid), Some(e.gid))
                    .map_err(|err| io("chown", err))?;
                continue;
            }
            k => {
                return Err(format!(
                    "{}: entry type {:?} is not unpacked",
                    e.path, k as char
                ));
            }
        }
        std::os::unix::fs::chown(&dest, Some(e.uid), Some(e.gid))
            .map_err(|err| io("chown", err))?;
        std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(e.mode))
            .map_err(|err| io("chmod", err))?;
    }
    Ok(())
}

// ---------------------------------------------------------------------- OCI

/// An image read from its archive, every digest checked.
#[derive(Debug, Clone)]
struct Image {
    /// The config blob.
    config: Value,
    /// Each layer's entries, bottom first.
    layers: Vec<Vec<TarEntry>>,
}

impl Image {
    /// `config.config[key]`: the runtime settings.
    fn run(&self, key: &str) -> &Value {
        &self.config["config"][key]
    }

    /// Every path of the image, as the last layer holding it leaves it.
    fn files(&self) -> BTreeMap<&str, &TarEntry> {
        let all = self.layers.iter().flatten();
        all.map(|e| (e.path.as_str(), e)).collect()
    }

    /// `Env` as a map.
    fn env(&self) -> BTreeMap<String, String> {
        let vars = self.run("Env").as_array().into_iter().flatten();
        vars.filter_map(Value::as_str)
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// `User` as uid and gid (numeric, as the kubelet needs to check
    /// runAsNonRoot).
    fn user(&self) -> Option<(u32, u32)> {
        let (u, g) = self.run("User").as_str()?.split_once(':')?;
        Some((u.parse().ok()?, g.parse().ok()?))
    }
}

/// The blob `desc` names, checked against it: media type, size, sha256.
/// Its path goes into `used`.
fn blob<'a>(
    files: &'a BTreeMap<String, Vec<u8>>,
    desc: &Value,
    media_type: &str,
    used: &mut BTreeSet<String>,
) -> Result<&'a [u8], String> {
    let digest = desc["digest"].as_str().unwrap_or_default();
    if desc["mediaType"] != media_type {
        return Err(format!(
            "{digest}: media type {}, not {media_type}",
            desc["mediaType"]
        ));
    }
    let hex = digest
        .strip_prefix("sha256:")
        .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or_else(|| format!("{digest:?} is not a sha256 digest"))?;
    let path = format!("blobs/sha256/{hex}");
    let data = files
        .get(&path)
        .ok_or_else(|| format!("{path} is not in the archive"))?;
    if desc["size"].as_u64() != Some(data.len() as u64) {
        return Err(format!(
            "{path} has {} bytes, its descriptor says {}",
            data.len(),
            desc["size"]
        ));
    }
    if sha256_hex(data) != hex {
        return Err(format!("{path}'s sha256 is {}", sha256_hex(data)));
    }
    used.insert(path);
    Ok(data)
}

fn json(data: &[u8], what: &str) -> Result<Value, String> {
    serde_json::from_slice(data).map_err(|e| format!("{what} is not JSON: {e}"))
}

/// The image in an `oci-archive:` tar named `reference`, with every blob,
/// layer and the docker-archive manifest checked.
fn open_image(archive: &[u8], reference: &str) -> Result<Image, String> {
    let mut files = BTreeMap::new();
    for e in read_tar(archive)? {
        match (e.kind, e.path.as_str()) {
            (b'5', "blobs" | "blobs/sha256") => {}
            (b'0' | 0, _) => {
                files.insert(e.path, e.data);
            }
            _ => return Err(format!("unexpected entry {:?} in the archive", e.path)),
        }
    }
    let file = |name: &str| {
        let data = files.get(name).ok_or(format!("no {name}"))?;
        json(data, name)
    };
    let layout = file("oci-layout")?;
    if layout != serde_json::json!({"imageLayoutVersion": "1.0.0"}) {
        return Err(format!("oci-layout is {layout}"));
    }
    let index = file("index.json")?;
    if index["schemaVersion"] != 2 || index["mediaType"] != OCI_INDEX {
        return Err(format!("index.json is not an OCI index: {index}"));
    }
    let [desc] = index["manifests"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
    else {
        return Err(format!("index.json must list one manifest: {index}"));
    };
    let name = &desc["annotations"]["org.opencontainers.image.ref.name"];
    if name != reference {
        return Err(format!(
            "index.json names the image {name}, not {reference:?}"
        ));
    }
    let mut used = BTreeSet::new();
    let manifest = json(blob(&files, desc, OCI_MANIFEST, &mut used)?, "the manifest")?;
    if manifest["schemaVersion"] != 2 || manifest["mediaType"] != OCI_MANIFEST {
        return Err(format!("not an OCI image manifest: {manifest}"));
    }
    let config = json(
        blob(&files, &manifest["config"], OCI_CONFIG, &mut used)?,
        "the config",
    )?;
    let diff_ids = config["rootfs"]["diff_ids"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let descs = manifest["layers"].as_array().cloned().unwrap_or_default();
    if descs.is_empty() || descs.len() != diff_ids.len() {
        return Err(format!(
            "{} layers but {} diff_ids in the config",
            descs.len(),
            diff_ids.len()
        ));
    }
    let mut layers = Vec::new();
    for (desc, diff_id) in descs.iter().zip(&diff_ids) {
        let gz = blob(&files, desc, OCI_LAYER, &mut used)?;
        let mut tar = Vec::new();
        flate2::read::GzDecoder::new(gz)
            .read_to_end(&mut tar)
            .map_err(|e| format!("layer {}: not gzip: {e}", desc["digest"]))?;
        if *diff_id != format!("sha256:{}", sha256_hex(&tar)) {
            return Err(format!(
                "layer {} unpacks to sha256:{}, the config's diff_id is {diff_id}",
                desc["digest"],
                sha256_hex(&tar)
            ));
        }
        layers.push(read_tar(&tar).map_err(|e| format!("layer {}: {e}", desc["digest"]))?);
    }
    let blob_path =
        |d: &Value| format!("blobs/sha256/{}", &d["digest"].as_str().unwrap_or("")[7..]);
    let legacy = serde_json::json!([{
        "Config": blob_path(&manifest["config"]),
        "RepoTags": [reference],
        "Layers": descs.iter().map(blob_path).collect::<Vec<_>>(),
    }]);
    if file("manifest.json")? != legacy {
        return Err(format!(
            "manifest.json is {}, expected {legacy}",
            file("manifest.json")?
        ));
    }
    used.extend(["oci-layout", "index.json", "manifest.json"].map(String::from));
    let stray: Vec<&String> = files.keys().filter(|p| !used.contains(*p)).collect();
    if !stray.is_empty() {
        return Err(format!("files that no descriptor names: {stray:?}"));
    }
    Ok(Image { config, layers })
}

const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const OCI_LAYER: &str = "application/vnd.oci.image.layer.v1.tar+gzip";

/// The image in the archive at `path`, which deploy/kubernetes/ names
/// `reference`.
fn open(path: &Path, reference: &str) -> Image {
    open_image(&read(path), reference).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

// ------------------------------------------------------ deploy/kubernetes/

/// What the images must agree with in deploy/kubernetes/, all as JSON.
#[derive(Debug)]
struct Deploy {
    /// The gateway's Deployment.
    deployment: Value,
    /// gateway.yaml's gateway.toml.
    gateway_toml: Value,
    /// worker.yaml's worker.toml.
    worker_toml: Value,
}

impl Deploy {
    fn load() -> Deploy {
        let mut docs = Vec::new();
        for file in ["gateway.yaml", "worker.yaml"] {
            let path = workspace_root().join("deploy/kubernetes").join(file);
            let text = String::from_utf8(read(&path)).expect("YAML is UTF-8");
            for de in serde_yaml::Deserializer::from_str(&text) {
                docs.push(Value::deserialize(de).unwrap_or_else(|e| panic!("{file}: {e}")));
            }
        }
        let find = |kind: &str, name: &str| {
            let doc = docs
                .iter()
                .find(|d| d["kind"] == kind && d["metadata"]["name"] == name);
            doc.cloned().unwrap_or_else(|| panic!("no {kind} {name}"))
        };
        let toml_of = |config_map: &str, key: &str| -> Value {
            let text = find("ConfigMap", config_map)["data"][key].clone();
            toml::from_str(text.as_str().unwrap_or_default())
                .unwrap_or_else(|e| panic!("{config_map} {key}: {e}"))
        };
        Deploy {
            deployment: find("Deployment", "tidegate-gateway"),
            gateway_toml: toml_of("tidegate-gateway", "gateway.toml"),
            worker_toml: toml_of("tidegate-worker", "worker.toml"),
        }
    }

    fn pod(&self) -> &Value {
        &self.deployment["spec"]["template"]["spec"]
    }

    fn container(&self) -> &Value {
        &self.pod()["containers"][0]
    }

    /// The Deployment's image: the gateway's.
    fn gateway_image(&self) -> String {
        string(&self.container()["image"])
    }

    /// `[leasing.kubernetes] image`: the workers', which run on CUDA
    /// (`tidegate-worker-cuda`).
    fn worker_image(&self) -> String {
        string(&self.kubernetes()["image"])
    }

    /// The CPU worker's image: the same name without `-cuda`.
    fn cpu_worker_image(&self) -> String {
        let cuda = self.worker_image();
        assert!(
            cuda.contains("/tidegate-worker-cuda:"),
            "[leasing.kubernetes] image {cuda:?} is not a tidegate-worker-cuda"
        );
        cuda.replacen("/tidegate-worker-cuda:", "/tidegate-worker:", 1)
    }

    /// `[leasing.kubernetes]` of gateway.toml: the worker Pods.
    fn kubernetes(&self) -> &Value {
        &self.gateway_toml["leasing"]["kubernetes"]
    }

    /// The folder of the gateway's ledger: its volume.
    fn ledger_dir(&self) -> String {
        let ledger = self.gateway_toml["leasing"]["ledger"]
            .as_str()
            .unwrap_or("/");
        let dir = Path::new(ledger).parent().unwrap_or(Path::new("/"));
        dir.to_string_lossy().into_owned()
    }
}

fn strings(v: &Value) -> Vec<String> {
    let items = v.as_array().into_iter().flatten();
    items.filter_map(|s| s.as_str().map(String::from)).collect()
}

fn string(v: &Value) -> String {
    v.as_str().unwrap_or_default().to_string()
}

/// `path` (absolute) in the image, following a symlink in its folder.
fn resolve<'a>(files: &BTreeMap<&str, &'a TarEntry>, path: &str) -> Option<&'a TarEntry> {
    let e = *files.get(path.trim_start_matches('/'))?;
    if e.kind != b'2' {
        return Some(e);
    }
    let target = Path::new(path).parent()?.join(&e.link);
    files.get(target.to_str()?.trim_start_matches('/')).copied()
}

/// Whether the image runs what the Pod says: an entrypoint that is one
/// executable file (the Pod sets no `command`), `Cmd` the Pod's `args`,
/// and a numeric non-root user; and has a directory at each of `mounts`.
fn check_pod(
    img: &Image,
    command: &Value,
    args: &Value,
    mounts: &[String],
    who: &str,
) -> Vec<String> {
    let mut problems = Vec::new();
    let files = img.files();
    let entry = strings(img.run("Entrypoint"));
    match entry.as_slice() {
        [exe] if resolve(&files, exe).is_some_and(|e| e.kind == b'0' && e.mode & 0o111 != 0) => {}
        _ => problems.push(format!(
            "{who}: Entrypoint {entry:?} is not one executable file"
        )),
    }
    if !strings(command).is_empty() {
        problems.push(format!(
            "{who}: the Pod's command {command} replaces the entrypoint"
        ));
    }
    if img.run("Cmd") != args {
        problems.push(format!(
            "{who}: Cmd {} is not the Pod's args {args}",
            img.run("Cmd")
        ));
    }
    if img.user().is_none_or(|(u, _)| u == 0) {
        let user = img.run("User");
        problems.push(format!(
            "{who}: User {user} is not a numeric non-root user (runAsNonRoot)"
        ));
    }
    for m in mounts {
        let is_dir = files
            .get(m.trim_start_matches('/'))
            .is_some_and(|e| e.kind == b'5');
        if !is_dir {
            problems.push(format!(
                "{who}: {m} (mounted over) is not a directory of the image"
            ));
        }
    }
    problems
}

/// The Debian package that installed `path` on this machine (under either
/// spelling of a merged /usr), as `dpkg-query -S` says.
fn owning_package(path: &str) -> Option<String> {
    let other = match path.strip_prefix("/usr") {
        Some(rest) => rest.to_string(),
        None => format!("/usr{path}"),
    };
    [path.to_string(), other].into_iter().find_map(|p| {
        let out = Command::new("dpkg-query").args(["-S", &p]).output().ok()?;
        let text = String::from_utf8_lossy(&out.stdout);
        let pkg = text.lines().next()?.split(": ").next()?.split(':').next()?;
        (out.status.success() && !pkg.is_empty()).then(|| pkg.to_string())
    })
}

/// Whether the image carries the licences of what it ships: tidegate's
/// LICENSE, the Debian copyright file of every system library's package,
/// and the `notices` (image paths) of what else it ships.
fn check_licences(img: &Image, notices: &[&str], who: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let files = img.files();
    let ours = std::fs::read(workspace_root().join("LICENSE")).expect("the repository's LICENSE");
    if files.get("usr/share/doc/tidegate/LICENSE").map(|e| &e.data) != Some(&ours) {
        problems.push(format!(
            "{who}: /usr/share/doc/tidegate/LICENSE is not tidegate's LICENSE"
        ));
    }
    let libraries = files.iter().filter(|(p, e)| {
        e.kind == b'0'
            && ["lib/", "lib64/", "usr/lib/"]
                .iter()
                .any(|d| p.starts_with(d))
            && p.contains(".so")
    });
    for (path, _) in libraries {
        match owning_package(&format!("/{path}")) {
            Some(pkg) => {
                let copyright = format!("usr/share/doc/{pkg}/copyright");
                if files
                    .get(copyright.as_str())
                    .is_none_or(|e| e.data.is_empty())
                {
                    problems.push(format!("{who}: /{path} ships without /{copyright}"));
                }
            }
            None => problems.push(format!("{who}: no Debian package here owns /{path}")),
        }
    }
    for n in notices {
        if resolve(&files, n).is_none_or(|e| e.kind != b'0' || e.data.is_empty()) {
            problems.push(format!("{who}: {n} is missing or empty"));
        }
    }
    problems
}

/// The gateway's image against its Deployment.
fn check_gateway_image(img: &Image, d: &Deploy) -> Vec<String> {
    let c = d.container();
    let mounts = c["volumeMounts"].as_array().into_iter().flatten();
    let mounts: Vec<String> = mounts.map(|m| string(&m["mountPath"])).collect();
    let mut problems = check_pod(img, &c["command"], &c["args"], &mounts, "gateway");
    problems.extend(check_licences(img, &[], "gateway"));
    let sc = &d.pod()["securityContext"];
    let want = (sc["runAsUser"].as_u64(), sc["runAsGroup"].as_u64());
    if img
        .user()
        .map(|(u, g)| (Some(u64::from(u)), Some(u64::from(g))))
        != Some(want)
    {
        problems.push(format!(
            "gateway: User {} is not runAsUser:runAsGroup {want:?}",
            img.run("User")
        ));
    }
    let ports = c["ports"].as_array().into_iter().flatten();
    let ports: BTreeSet<String> = ports
        .map(|p| {
            format!(
                "{}/{}",
                p["containerPort"],
                string(&p["protocol"]).to_ascii_lowercase()
            )
        })
        .collect();
    let exposed = img.run("ExposedPorts").as_object();
    let exposed: BTreeSet<String> = exposed
        .into_iter()
        .flat_map(|o| o.keys().cloned())
        .collect();
    if ports != exposed {
        problems.push(format!(
            "gateway: ExposedPorts {exposed:?}, the Deployment's ports {ports:?}"
        ));
    }
    let ledger = img
        .files()
        .get(d.ledger_dir().trim_start_matches('/'))
        .map(|e| (e.uid, e.gid));
    if ledger != img.user() {
        problems.push(format!(
            "gateway: {} is not the image user's",
            d.ledger_dir()
        ));
    }
    problems
}

/// The worker's image against the worker Pods of `[leasing.kubernetes]`
/// and worker.yaml's worker.toml: ONNX Runtime where `runtime.library` (and
/// `ORT_DYLIB_PATH`) say, and the models `models.only` serves, no other.
fn check_worker_image(img: &Image, d: &Deploy) -> Vec<String> {
    let k8s = d.kubernetes();
    let mounts = k8s["mounts"].as_array().into_iter().flatten();
    let mounts: Vec<String> = mounts.map(|m| string(&m["path"])).collect();
    let mut problems = check_pod(img, &k8s["command"], &k8s["args"], &mounts, "worker");
    let ort_notices = [
        "/usr/share/doc/onnxruntime/LICENSE",
        "/usr/share/doc/onnxruntime/ThirdPartyNotices.txt",
    ];
    problems.extend(check_licences(img, &ort_notices, "worker"));
    let run_as = k8s["run_as_user"].as_u64();
    if let Some(u) = run_as
        && img.user().map(|(uid, _)| u64::from(uid)) != Some(u)
    {
        problems.push(format!(
            "worker: User {} is not run_as_user {u}",
            img.run("User")
        ));
    }
    let files = img.files();
    let library = string(&d.worker_toml["runtime"]["library"]);
    let is_file = resolve(&files, &library).is_some_and(|e| e.kind == b'0');
    if !is_file {
        problems.push(format!(
            "worker: runtime.library {library:?} is not a file of the image"
        ));
    }
    if img.env().get("ORT_DYLIB_PATH") != Some(&library) {
        problems.push(format!(
            "worker: ORT_DYLIB_PATH is not runtime.library {library:?}"
        ));
    }
    let dir = string(&d.worker_toml["models"]["dir"]);
    let prefix = format!("{}/", dir.trim_start_matches('/'));
    let shipped: BTreeSet<&str> = files
        .keys()
        .filter_map(|p| p.strip_prefix(&prefix)?.strip_suffix("/model.toml"))
        .collect();
    let only = strings(&d.worker_toml["models"]["only"]);
    let served: BTreeSet<&str> = only.iter().map(String::as_str).collect();
    if !served.is_empty() && shipped != served {
        problems.push(format!(
            "worker: models {shipped:?} under {dir}, worker.toml serves {served:?}"
        ));
    }
    for m in &served {
        let spec = resolve(&files, &format!("{dir}/{m}/model.toml"));
        let spec: Option<Value> = spec.and_then(|e| toml::from_slice(&e.data).ok());
        let onnx = spec.map(|s| format!("{dir}/{m}/{}", string(&s["file"])));
        let is_file = onnx.is_some_and(|f| resolve(&files, &f).is_some_and(|e| e.kind == b'0'));
        if !is_file {
            problems.push(format!(
                "worker: model {m} has no model.toml and model file under {dir}"
            ));
        }
    }
    problems
}

/// What ONNX Runtime's CUDA provider and the worker's GPU preprocessing
/// load by name at run time, so that no ELF header lists them: cuDNN 9 and
/// its parts, cuFFT, NVRTC 12 (the kernel; cudarc is built for CUDA 12) and
/// NVRTC 13 (cuDNN's runtime-compiled engines).
const LOADED_BY_NAME: &[&str] = &[
    "libcudnn.so.9",
    "libcudnn_graph.so.9",
    "libcudnn_ops.so.9",
    "libcudnn_cnn.so.9",
    "libcudnn_adv.so.9",
    "libcudnn_heuristic.so.9",
    "libcudnn_engines_precompiled.so.9",
    "libcudnn_engines_runtime_compiled.so.9",
    "libcufft.so.12",
    "libnvrtc.so.12",
    "libnvrtc.so.13",
];

/// The NVIDIA packages whose libraries the CUDA worker's image ships, each
/// with its licence in /usr/share/doc/PACKAGE/License.txt.
const NVIDIA_PACKAGES: &[&str] = &[
    "nvidia-cuda-runtime",
    "nvidia-cublas",
    "nvidia-curand",
    "nvidia-cufft",
    "nvidia-nvjitlink",
    "nvidia-cuda-nvrtc",
    "nvidia-cudnn-cu13",
    "nvidia-cuda-nvrtc-cu12",
];

/// The driver's library: the node's, mounted by the NVIDIA container
/// toolkit; an image that shipped its own would not match the node's driver.
const DRIVER_LIBRARY: &str = "libcuda.so.1";

/// What only a worker built with the `cuda` feature holds: its kernel.
const CUDA_KERNEL: &[u8] = b"extern \"C\" __global__ void tidegate_preprocess(";

/// The CUDA worker's image, beyond what [`check_worker_image`] checks: a
/// worker built with the `cuda` feature; ONNX Runtime's CUDA provider
/// beside `runtime.library`; what is loaded by name ([`LOADED_BY_NAME`]) on
/// `LD_LIBRARY_PATH`; no driver library; the NVIDIA container toolkit's
/// variables; the NVIDIA licences.
fn check_cuda_worker_image(img: &Image, d: &Deploy) -> Vec<String> {
    let mut problems = Vec::new();
    let files = img.files();
    let env = img.env();
    let entry = strings(img.run("Entrypoint"));
    let exe = entry.first().and_then(|e| resolve(&files, e));
    if !exe.is_some_and(|e| e.data.windows(CUDA_KERNEL.len()).any(|w| w == CUDA_KERNEL)) {
        problems.push("worker-cuda: the worker is not built with the `cuda` feature".into());
    }
    let library = string(&d.worker_toml["runtime"]["library"]);
    let provider = Path::new(&library).with_file_name("libonnxruntime_providers_cuda.so");
    let provider = provider.to_string_lossy();
    if resolve(&files, &provider).is_none_or(|e| e.kind != b'0') {
        problems.push(format!("worker-cuda: no CUDA provider at {provider}"));
    }
    let path = env.get("LD_LIBRARY_PATH").cloned().unwrap_or_default();
    let dirs: Vec<&str> = path.split(':').filter(|d| d.starts_with('/')).collect();
    let on_path = |name: &str| {
        dirs.iter()
            .any(|d| resolve(&files, &format!("{d}/{name}")).is_some_and(|e| e.kind == b'0'))
    };
    for name in LOADED_BY_NAME {
        if !on_path(name) {
            problems.push(format!(
                "worker-cuda: {name} is not on LD_LIBRARY_PATH {path:?}"
            ));
        }
    }
    // NVRTC loads its builtins, of its own release, by name too.
    let builtins = dirs.iter().any(|d| {
        let prefix = format!("{}/libnvrtc-builtins.so.12.", d.trim_start_matches('/'));
        files.keys().any(|p| p.starts_with(&prefix))
    });
    if !builtins {
        problems.push("worker-cuda: no libnvrtc-builtins.so.12.* beside NVRTC 12".into());
    }
    let driver: Vec<&&str> = files
        .keys()
        .filter(|p| p.rsplit('/').next() == Some(DRIVER_LIBRARY))
        .collect();
    if !driver.is_empty() {
        problems.push(format!(
            "worker-cuda: ships the driver's {DRIVER_LIBRARY} ({driver:?}), which must be the node's"
        ));
    }
    let capabilities = env.get("NVIDIA_DRIVER_CAPABILITIES").cloned();
    if !capabilities.is_some_and(|c| c.split(',').any(|c| c == "compute" || c == "all")) {
        problems.push("worker-cuda: NVIDIA_DRIVER_CAPABILITIES lacks compute".into());
    }
    if !env
        .get("NVIDIA_REQUIRE_CUDA")
        .is_some_and(|r| r.starts_with("cuda>="))
    {
        problems.push("worker-cuda: no NVIDIA_REQUIRE_CUDA=cuda>=…".into());
    }
    let notices: Vec<String> = NVIDIA_PACKAGES
        .iter()
        .map(|p| format!("/usr/share/doc/{p}/License.txt"))
        .collect();
    let notices: Vec<&str> = notices.iter().map(String::as_str).collect();
    problems.extend(check_licences(img, &notices, "worker-cuda"));
    problems
}

/// The section names of a 64-bit little-endian ELF file.
fn elf_sections(elf: &[u8]) -> Vec<String> {
    let num = |at: usize, len: usize| {
        let b = &elf[at..at + len];
        b.iter().rev().fold(0usize, |n, &x| n << 8 | usize::from(x))
    };
    let (shoff, shentsize, shnum, shstrndx) =
        (num(0x28, 8), num(0x3a, 2), num(0x3c, 2), num(0x3e, 2));
    let header = |i: usize| shoff + i * shentsize;
    let strtab = num(header(shstrndx) + 0x18, 8);
    (0..shnum)
        .map(|i| {
            let name = &elf[strtab + num(header(i), 4)..];
            let end = name.iter().position(|&b| b == 0).unwrap_or(0);
            String::from_utf8_lossy(&name[..end]).into_owned()
        })
        .collect()
}

#[test]
fn images_are_oci_archives_that_agree_with_the_manifests_and_rebuild_to_the_same_bytes() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let builds = (start_build(a.path(), None), start_build(b.path(), None));
    let first = finish_build(builds.0, a.path());
    let second = finish_build(builds.1, b.path());
    for (one, two) in [
        (&first.gateway, &second.gateway),
        (&first.worker, &second.worker),
    ] {
        let same = read(one) == read(two);
        assert!(
            same,
            "two builds of {} differ: the build is not reproducible",
            one.display()
        );
    }
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    };
    let d = Deploy::load();
    let gateway = open(&first.gateway, &d.gateway_image());
    let worker = open(&first.worker, &d.cpu_worker_image());
    for (img, binary) in [(&gateway, "tidegate-gateway"), (&worker, "tidegate-worker")] {
        assert_eq!(img.config["os"], "linux");
        assert_eq!(img.config["architecture"], arch);
        let labels = img.run("Labels");
        assert_eq!(
            labels["org.opencontainers.image.version"],
            env!("CARGO_PKG_VERSION")
        );
        assert_eq!(labels["org.opencontainers.image.title"], binary);
        let files = img.files();
        let exe = resolve(&files, &strings(img.run("Entrypoint"))[0]).unwrap();
        let dwarf = [".debug_info", ".debug_line", ".debug_str"];
        let debug: Vec<String> = elf_sections(&exe.data)
            .into_iter()
            .filter(|s| dwarf.contains(&s.as_str()))
            .collect();
        assert!(debug.is_empty(), "{binary} is not stripped: {debug:?}");
        // Root's, but the ledger's folder, which is the gateway's.
        for e in img.layers.iter().flatten() {
            let owner = (e.uid, e.gid);
            let ledger = format!("/{}", e.path) == d.ledger_dir() && img.user() == Some(owner);
            assert!(
                owner == (0, 0) || ledger,
                "{binary}: {} is owned by {owner:?}",
                e.path
            );
        }
    }
    assert_ok(check_gateway_image(&gateway, &d));
    assert_ok(check_worker_image(&worker, &d));
    // The CPU worker is not one for GPUs, and the checks of the CUDA
    // worker's image say why. (Under `--all-features` its binary has the
    // kernel, so it is wiped from a copy.)
    let mut cpu_only = worker.clone();
    let exe = strings(worker.run("Entrypoint"))[0]
        .trim_start_matches('/')
        .to_string();
    for e in cpu_only
        .layers
        .iter_mut()
        .flatten()
        .filter(|e| e.path == exe)
    {
        while let Some(at) = e
            .data
            .windows(CUDA_KERNEL.len())
            .position(|w| w == CUDA_KERNEL)
        {
            e.data[at..at + CUDA_KERNEL.len()].fill(0);
        }
    }
    let not_cuda = check_cuda_worker_image(&cpu_only, &d).join("\n");
    for why in [
        "not built with the `cuda` feature",
        "no CUDA provider",
        "libcudnn.so.9 is not on LD_LIBRARY_PATH",
        "libnvrtc.so.12 is not on LD_LIBRARY_PATH",
        "NVIDIA_DRIVER_CAPABILITIES",
        "nvidia-cudnn-cu13/License.txt is missing",
    ] {
        assert!(not_cuda.contains(why), "no {why:?} in:\n{not_cuda}");
    }
}

// ------------------------------------------------------------------ running

/// Whether this process runs as root (effective uid 0).
fn is_root() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let uid = status.lines().find_map(|l| l.strip_prefix("Uid:"));
    uid.and_then(|ids| ids.split_whitespace().nth(1)) == Some("0")
}

/// Says why the test did not run; with `CI` set, that is a failure.
fn skip(test: &str, why: &str) {
    eprintln!("SKIPPED {test}: {why}; run it as root");
    assert!(
        std::env::var_os("CI").is_none(),
        "{test}: CI is set but {why}"
    );
}

/// `chroot`, which may be in an sbin folder off a user's PATH.
fn chroot_program() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let dirs = std::env::split_paths(&path).chain(["/usr/sbin".into(), "/sbin".into()]);
    dirs.map(|d| d.join("chroot"))
        .find(|p| p.is_file())
        .expect("chroot (coreutils) is installed")
}

/// An image unpacked into a temporary folder, with what a container
/// runtime adds: /dev's null, zero, random and urandom (the gateway draws
/// lease tokens from urandom).
#[derive(Debug)]
struct Rootfs<'a> {
    img: &'a Image,
    dir: tempfile::TempDir,
}

impl<'a> Rootfs<'a> {
    fn unpack(img: &'a Image) -> Rootfs<'a> {
        let dir = tempfile::tempdir().unwrap();
        unpack(&img.layers, dir.path()).unwrap_or_else(|e| panic!("unpacking: {e}"));
        std::fs::create_dir_all(dir.path().join("dev")).unwrap();
        for (name, minor) in [
            ("null", "3"),
            ("zero", "5"),
            ("random", "8"),
            ("urandom", "9"),
        ] {
            let node = dir.path().join("dev").join(name);
            let mut mknod = Command::new("mknod");
            mknod.args(["-m", "666"]).arg(&node).args(["c", "1", minor]);
            let ok = mknod.status().is_ok_and(|s| s.success());
            assert!(
                ok,
                "mknod -m 666 {} c 1 {minor} (coreutils)",
                node.display()
            );
        }
        Rootfs { img, dir }
    }

    /// `path` (absolute, in the image) here.
    fn path(&self, path: &str) -> PathBuf {
        self.dir.path().join(path.trim_start_matches('/'))
    }

    /// Writes a file at `path` in the image, root's and world-readable, as
    /// the kubelet mounts Secrets and ConfigMaps.
    fn mount(&self, path: &str, text: &[u8]) {
        let dest = self.path(path);
        std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
        std::fs::write(&dest, text).unwrap();
        std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(0o644)).unwrap();
    }

    /// The image's entrypoint with `args`, in this root as the image's
    /// user, with the image's `Env` and `env` and nothing else.
    fn command(&self, args: &[String], env: &[(String, String)]) -> Command {
        let mut cmd = Command::new(chroot_program());
        cmd.env_clear()
            .envs(self.img.env())
            .envs(env.iter().cloned())
            .arg(format!("--userspec={}", string(self.img.run("User"))))
            .arg(self.dir.path())
            .args(strings(self.img.run("Entrypoint")))
            .args(args)
            .stdin(Stdio::null());
        cmd
    }

    /// Every file and symlink with its size and mtime.
    fn snapshot(&self) -> BTreeMap<PathBuf, (u64, SystemTime)> {
        let mut out = BTreeMap::new();
        let mut todo = vec![self.dir.path().to_path_buf()];
        while let Some(dir) = todo.pop() {
            for e in std::fs::read_dir(&dir).unwrap().map(Result::unwrap) {
                let meta = e.path().symlink_metadata().unwrap();
                if meta.is_dir() {
                    todo.push(e.path());
                } else {
                    let rel = e
                        .path()
                        .strip_prefix(self.dir.path())
                        .unwrap()
                        .to_path_buf();
                    out.insert(rel, (meta.len(), meta.modified().unwrap()));
                }
            }
        }
        out
    }
}

/// A process, killed and reaped on drop.
#[derive(Debug)]
struct Running {
    child: Child,
    log: PathBuf,
}

impl Running {
    /// Starts `cmd` with its stderr in `log`.
    fn start(mut cmd: Command, log: PathBuf) -> Running {
        let err = std::fs::File::create(&log).expect("log file");
        let child = cmd
            .stdout(Stdio::piped())
            .stderr(err)
            .spawn()
            .expect("chroot starts");
        Running { child, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Fails, with its log, if it has exited.
    fn assert_running(&mut self, who: &str) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!("{who} exited with {status}; its log:\n{}", self.log());
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `GET path` on the gateway's HTTP listener: the body of a 200 answer.
fn get(addr: SocketAddr, path: &str) -> Option<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    (head.split_whitespace().nth(1) == Some("200")).then(|| body.to_string())
}

/// `listening quic=ADDR http=ADDR`, the gateway's first line on stdout.
fn listening_addrs(gateway: &mut Running) -> (SocketAddr, SocketAddr) {
    let stdout = gateway.child.stdout.take().expect("piped stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx.recv_timeout(WAIT).unwrap_or_default();
    let addr = |key: &str| {
        let word = line.split_whitespace().find_map(|w| w.strip_prefix(key));
        word.and_then(|a| a.parse().ok()).unwrap_or_else(|| {
            panic!(
                "the gateway printed {line:?}, not {key}ADDR; its log:\n{}",
                gateway.log()
            )
        })
    };
    (addr("quic="), addr("http="))
}

/// The edges' and the worker's tokens in these tests.
const EDGE_TOKEN: &str = "edge-token-of-this-test";
const WORKER_TOKEN: &str = "worker-token-of-this-test";

/// gateway.yaml's gateway.toml, run here: both listeners on free loopback
/// ports, the edges' token [`EDGE_TOKEN`], and the `static` provider in
/// place of Kubernetes (whose keys go): worker.toml's worker, on demand, of
/// the first model's first instance type, with [`WORKER_TOKEN`].
fn gateway_toml(d: &Deploy) -> String {
    let hash = tidegate_gateway::auth::hash_token;
    let mut t = d.gateway_toml.clone();
    t["quic"]["listen"] = "127.0.0.1:0".into();
    t["http"]["listen"] = "127.0.0.1:0".into();
    for e in t["edges"].as_array_mut().expect("[[edges]]") {
        e["token_sha256"] = hash(EDGE_TOKEN).into();
    }
    let leasing = t["leasing"].as_object_mut().expect("[leasing]");
    leasing.remove("kubernetes");
    // "keep" is for providers whose workers outlive the gateway.
    leasing.remove("on_stop");
    leasing.insert("provider".into(), "static".into());
    let instance_type = leasing["models"][0]["instance_types"][0].clone();
    leasing.insert(
        "static_workers".into(),
        serde_json::json!([{
            "name": d.worker_toml["name"],
            "instance_type": instance_type,
            "tier": "on_demand",
            "token_sha256": hash(WORKER_TOKEN),
        }]),
    );
    toml::to_string(&t).expect("gateway.toml serializes")
}

/// Runs `tidegate-loadtest` against the gateway at `quic` (one camera,
/// 5 fps, 2 s, BlazeFace) and returns its report.
fn send_frames(quic: SocketAddr, ca: &Path, edge: &str, dir: &Path) -> Value {
    let report = dir.join("report.json");
    let log = dir.join("loadtest.log");
    let mut cmd = Command::new(bin("tidegate-loadtest"));
    cmd.arg("--gateway")
        .arg(quic.to_string())
        .arg("--ca")
        .arg(ca)
        .args([
            "--edge",
            edge,
            "--token",
            EDGE_TOKEN,
            "--model",
            "blazeface",
            "--cameras",
            "1",
        ])
        .args([
            "--fps",
            "5",
            "--seconds",
            "2",
            "--budget-ms",
            "1000",
            "--report",
        ])
        .arg(&report)
        .env("TIDEGATE_LOG", "warn");
    let mut loadtest = Running::start(cmd, log);
    let until = Instant::now() + WAIT;
    let status = loop {
        if let Some(s) = loadtest.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < until,
            "tidegate-loadtest ran past {WAIT:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        status.success(),
        "tidegate-loadtest: {status}\n{}",
        loadtest.log()
    );
    serde_json::from_slice(&read(&report)).expect("the report is JSON")
}

#[test]
fn under_chroot_the_worker_image_registers_with_the_gateway_image_and_serves_frames() {
    let test = "under_chroot_the_worker_image_registers_with_the_gateway_image_and_serves_frames";
    if !is_root() {
        return skip(test, "chroot needs root");
    }
    let started = Instant::now();
    let d = Deploy::load();
    let out = tempfile::tempdir().unwrap();
    let archives = finish_build(start_build(out.path(), None), out.path());
    let (gw, wk) = (
        open(&archives.gateway, &d.gateway_image()),
        open(&archives.worker, &d.cpu_worker_image()),
    );
    let (gw_root, wk_root) = (Rootfs::unpack(&gw), Rootfs::unpack(&wk));
    let logs = tempfile::tempdir().unwrap();

    // The certificate README.md makes, for the gateway's Service, and for
    // localhost, which tidegate-loadtest checks; made by the image itself.
    let service = string(&d.worker_toml["gateway"]["server_name"]);
    let args = format!("dev-certs --out /tmp/certs --name {service} --name localhost");
    let args: Vec<String> = args.split_whitespace().map(String::from).collect();
    let made = gw_root.command(&args, &[]).output().expect("chroot runs");
    assert!(
        made.status.success(),
        "dev-certs in the gateway's image: {made:?}"
    );
    let cert = |name: &str| read(&gw_root.path("/tmp/certs").join(name));
    let ca = gw_root.path("/tmp/certs/ca.pem");

    // The gateway's Pod: its Secret, its ConfigMap, its args and env.
    gw_root.mount(
        &string(&d.gateway_toml["quic"]["cert"]),
        &cert("gateway.pem"),
    );
    gw_root.mount(
        &string(&d.gateway_toml["quic"]["key"]),
        &cert("gateway.key"),
    );
    let c = d.container();
    let args = strings(&c["args"]);
    gw_root.mount(&args[1], gateway_toml(&d).as_bytes());
    let env = c["env"].as_array().into_iter().flatten();
    let env: Vec<(String, String)> = env
        .map(|e| (string(&e["name"]), string(&e["value"])))
        .collect();
    let before = gw_root.snapshot();
    let mut gateway = Running::start(
        gw_root.command(&args, &env),
        logs.path().join("gateway.log"),
    );
    let (quic, http) = listening_addrs(&mut gateway);

    // A worker Pod: the tidegate-ca Secret, worker.toml on the CPU (the
    // image is ONNX Runtime's CPU build), [leasing.kubernetes] args and env
    // with the gateway's port, and the kubelet's /etc/hosts, where the
    // gateway's Service is.
    let k8s = d.kubernetes();
    let mut env: Vec<(String, String)> = k8s["env"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, v)| (k.clone(), string(v)))
        .collect();
    for (k, v) in &mut env {
        if k == "TIDEGATE_GATEWAY_ADDR" {
            *v = format!(
                "{}:{}",
                v.rsplit_once(':').expect("host:port").0,
                quic.port()
            );
        }
    }
    env.push(("TIDEGATE_WORKER_TOKEN".into(), WORKER_TOKEN.into()));
    let ca_path = env
        .iter()
        .find(|(k, _)| k == "TIDEGATE_CA")
        .map(|(_, v)| v.clone());
    wk_root.mount(&ca_path.expect("TIDEGATE_CA"), &read(&ca));
    let mut worker_toml = d.worker_toml.clone();
    worker_toml["runtime"]["provider"] = "cpu".into();
    let args = strings(&k8s["args"]);
    wk_root.mount(&args[1], toml::to_string(&worker_toml).unwrap().as_bytes());
    wk_root.mount(
        "/etc/hosts",
        format!("127.0.0.1\tlocalhost\n127.0.0.1\t{service}\n").as_bytes(),
    );
    let mut worker = Running::start(wk_root.command(&args, &env), logs.path().join("worker.log"));

    // Registered, and bound to the static lease: dispatched to.
    let until = Instant::now() + WAIT;
    loop {
        let workers = get(http, "/api/v1/workers").and_then(|b| serde_json::from_str(&b).ok());
        let workers: Value = workers.unwrap_or_default();
        let mut all = workers.as_array().into_iter().flatten();
        if all.any(|w| w["name"] == d.worker_toml["name"] && w["unbound"] == false) {
            break;
        }
        gateway.assert_running("the gateway");
        worker.assert_running("the worker");
        assert!(
            Instant::now() < until,
            "the worker was not registered and bound within {WAIT:?}: {workers}\ngateway log:\n{}\nworker log:\n{}",
            gateway.log(),
            worker.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    let edge = string(&d.gateway_toml["edges"][0]["name"]);
    let report = send_frames(quic, &ca, &edge, logs.path());
    assert!(
        report["ok"].as_u64() > Some(0) && report["failed"] == 0,
        "frames not served: {report}\ngateway log:\n{}\nworker log:\n{}",
        gateway.log(),
        worker.log()
    );

    // Its root filesystem is read-only in the cluster: it wrote only its
    // ledger's volume and /tmp.
    gateway.assert_running("the gateway");
    let volumes = [d.ledger_dir(), "/tmp".to_string()];
    let after = gw_root.snapshot();
    let written: Vec<&PathBuf> = after
        .iter()
        .filter(|(p, m)| before.get(*p) != Some(m))
        .map(|(p, _)| p)
        .filter(|p| {
            !volumes
                .iter()
                .any(|v| Path::new("/").join(p).starts_with(v))
        })
        .collect();
    assert!(
        written.is_empty(),
        "the gateway wrote outside its volumes: {written:?}"
    );
    let ledger = gw_root.path(&string(&d.gateway_toml["leasing"]["ledger"]));
    let owner = std::fs::metadata(&ledger).map(|m| (m.uid(), m.gid()));
    assert_eq!(
        owner.ok(),
        gw.user(),
        "{} is not the gateway's",
        ledger.display()
    );
    eprintln!(
        "{test}: {} frames ok, {:.1} s in all",
        report["ok"],
        started.elapsed().as_secs_f64()
    );
}

/// What `path` links to, traced by the image's own loader in `root` as its
/// image's user with its `Env` (`LD_TRACE_LOADED_OBJECTS=1 ld.so PATH`, as
/// ldd does; `--list` stops at the first missing library): the sonames it
/// cannot find. Python does the chroot, so that the variable reaches only
/// the image's loader, not a dynamically linked chroot(1).
fn not_found(root: &Rootfs<'_>, loader: &str, path: &str) -> BTreeSet<String> {
    let (uid, gid) = root.img.user().expect("a numeric user");
    let script = "import os, sys\n\
        root, uid, gid, loader, path = sys.argv[1:]\n\
        os.chroot(root); os.chdir('/')\n\
        os.setgroups([]); os.setgid(int(gid)); os.setuid(int(uid))\n\
        env = dict(os.environ, LD_TRACE_LOADED_OBJECTS='1')\n\
        os.execve(loader, [loader, path], env)\n";
    let mut cmd = Command::new("python3");
    cmd.env_clear()
        .envs(root.img.env())
        .arg("-c")
        .arg(script)
        .arg(root.dir.path())
        .args([uid.to_string(), gid.to_string()])
        .args([loader, path])
        .stdin(Stdio::null());
    let out = cmd.output().expect("chroot runs");
    let text = String::from_utf8_lossy(&out.stdout);
    let listed = text.lines().filter(|l| l.contains(" => ")).count();
    assert!(listed > 0, "{loader} traced nothing of {path}: {out:?}");
    text.lines()
        .filter(|l| l.contains("=> not found"))
        .filter_map(|l| l.split_whitespace().next())
        .map(String::from)
        .collect()
}

#[test]
fn the_cuda_worker_image_holds_all_that_its_cuda_path_loads_but_the_driver_and_refuses_clearly_without_one()
 {
    let test = "the_cuda_worker_image_holds_all_that_its_cuda_path_loads_but_the_driver_and_refuses_clearly_without_one";
    let started = Instant::now();
    let d = Deploy::load();
    let out = tempfile::tempdir().unwrap();
    // Level 1: the CUDA libraries are 2.6 GB; the level changes no check.
    let build = start_build_with(out.path(), Some("worker-cuda"), &["--compress-level", "1"]);
    finish_build(build, out.path());
    let archive = out.path().join(format!(
        "tidegate-worker-cuda-{}.oci.tar",
        env!("CARGO_PKG_VERSION")
    ));
    let img = open(&archive, &d.worker_image());
    std::fs::remove_file(&archive).unwrap();
    drop(out);
    let mut problems = check_worker_image(&img, &d);
    problems.extend(check_cuda_worker_image(&img, &d));
    assert_ok(problems);
    if !is_root() {
        return skip(test, "chroot needs root");
    }
    let root = Rootfs::unpack(&img);
    let files = img.files();

    // Every library on its LD_LIBRARY_PATH, ONNX Runtime's and the worker
    // find all they link to in the image, as its user, with its loader
    // (traced, not run);
    // all but the driver's library, which the CUDA provider (and cuDNN's
    // runtime-compiled engines) link to and the node provides.
    let loader = ["/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-aarch64.so.1"]
        .into_iter()
        .find(|l| resolve(&files, l).is_some())
        .expect("the image has its dynamic loader");
    let env = img.env();
    let library = string(&d.worker_toml["runtime"]["library"]);
    let ort_dir = Path::new(&library)
        .parent()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let mut dirs: Vec<String> = env["LD_LIBRARY_PATH"]
        .split(':')
        .map(String::from)
        .collect();
    dirs.push(ort_dir.clone());
    let mut elves: Vec<String> = files
        .iter()
        .filter(|(p, e)| {
            e.kind == b'0'
                && p.contains(".so")
                && dirs
                    .iter()
                    .any(|d| p.starts_with(&format!("{}/", d.trim_start_matches('/'))))
        })
        .map(|(p, _)| format!("/{p}"))
        .collect();
    elves.sort();
    elves.dedup();
    elves.extend(strings(img.run("Entrypoint")));
    let mut needs_driver = BTreeSet::new();
    for elf in &elves {
        let missing = not_found(&root, loader, elf);
        let other: Vec<&String> = missing.iter().filter(|m| *m != DRIVER_LIBRARY).collect();
        assert!(
            other.is_empty(),
            "{elf} links to {other:?}, which the image does not have"
        );
        if !missing.is_empty() {
            needs_driver.insert(elf.rsplit('/').next().unwrap().to_string());
        }
    }
    assert!(
        needs_driver.contains("libonnxruntime_providers_cuda.so"),
        "the CUDA provider should link to {DRIVER_LIBRARY}, not in the image; of {} libraries, these do: {needs_driver:?}",
        elves.len()
    );

    // The worker Pod's worker.toml, unchanged: provider "cuda",
    // fallback "none".
    let args = strings(&d.kubernetes()["args"]);
    let config = args[1].clone();
    root.mount(&config, toml::to_string(&d.worker_toml).unwrap().as_bytes());
    let ca = string(&d.worker_toml["gateway"]["ca"]);
    // a real CA: check-config reads it as the worker's link does
    let certs = tempfile::tempdir().unwrap();
    let made = tidegate_gateway::certs::generate(certs.path(), &["localhost".to_string()]).unwrap();
    root.mount(&ca, &std::fs::read(&made.ca_cert).unwrap());
    let run = |more: &[&str]| {
        let mut all = args.clone();
        all.extend(more.iter().map(|s| s.to_string()));
        // As a lease starts it: with its one-time token.
        let token = [
            ("TIDEGATE_LEASE_ID".to_string(), "7".to_string()),
            ("TIDEGATE_LEASE_TOKEN".to_string(), WORKER_TOKEN.to_string()),
        ];
        let out = root.command(&all, &token).output().expect("chroot runs");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.code(), text)
    };

    // check-cuda: ONNX Runtime's GPU build with its CUDA provider, NVRTC 12
    // compiling the kernel in the image; no driver here.
    let (code, text) = run(&["check-cuda"]);
    assert_eq!(code, Some(1), "check-cuda without a driver:\n{text}");
    for line in [
        format!("ok       ONNX Runtime: {library}"),
        "ok       its CUDA execution provider: built in".into(),
        "MISSING  the NVIDIA driver and its devices: no CUDA driver".into(),
        "ok       NVRTC and the preprocessing kernel: compiles".into(),
    ] {
        assert!(
            text.contains(&line),
            "no {line:?} in check-cuda's output:\n{text}"
        );
    }

    // Started as a lease starts it, on a node without a driver: it refuses,
    // saying why, rather than serving on the CPU at GPU prices.
    let (code, text) = run(&[]);
    assert_eq!(code, Some(1), "the worker without a driver:\n{text}");
    assert!(
        text.contains("no CUDA driver"),
        "the worker's refusal does not say why:\n{text}"
    );

    // With fallback = "cpu", ONNX Runtime's GPU build serves the models on
    // the CPU.
    let mut fallback = d.worker_toml.clone();
    fallback["runtime"]["fallback"] = "cpu".into();
    root.mount(&config, toml::to_string(&fallback).unwrap().as_bytes());
    let (code, text) = run(&["check-config"]);
    assert_eq!(code, Some(0), "check-config with fallback = cpu:\n{text}");
    assert!(
        text.contains("load and run on cpu"),
        "not served on the CPU:\n{text}"
    );
    eprintln!(
        "{test}: {} libraries checked, {:.1} s in all",
        elves.len(),
        started.elapsed().as_secs_f64()
    );
}

// ------------------------------------------------- the checks can fail

/// Rewrites the name of the tar header at `at` and its checksum.
fn rename(archive: &mut [u8], at: usize, name: &str) {
    let header = &mut archive[at..at + 512];
    header[..100].fill(0);
    header[..name.len()].copy_from_slice(name.as_bytes());
    header[148..156].fill(b' ');
    let sum: u32 = header.iter().map(|&b| u32::from(b)).sum();
    header[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
}

/// The offset of the header of entry `name`.
fn header_of(archive: &[u8], name: &str) -> usize {
    (0..archive.len())
        .step_by(512)
        .find(|&at| archive[at..].starts_with(name.as_bytes()) && archive[at + name.len()] == 0)
        .unwrap_or_else(|| panic!("no entry {name}"))
}

#[test]
fn the_checks_fail_on_broken_archives_and_images() {
    let out = tempfile::tempdir().unwrap();
    let archives = finish_build(start_build(out.path(), None), out.path());
    let good = read(&archives.gateway);
    let d = Deploy::load();
    let name = d.gateway_image();
    open_image(&good, &name).unwrap();

    let e = open_image(&good, "ghcr.io/example/other:1").unwrap_err();
    assert!(e.contains("names the image"), "{e}");

    let mut changed = good.clone();
    let config = b"\"os\":\"linux\",\"rootfs\"";
    let at = changed.windows(config.len()).position(|w| w == config);
    let at = at.expect("the config is stored as written");
    changed[at + 10] = b'z'; // "linuz"
    let e = open_image(&changed, &name).unwrap_err();
    assert!(e.contains("sha256 is"), "{e}");

    let index: Value = {
        let entries = read_tar(&good).unwrap();
        let f = entries.iter().find(|e| e.path == "index.json").unwrap();
        serde_json::from_slice(&f.data).unwrap()
    };
    let manifest = &index["manifests"][0]["digest"].as_str().unwrap()[7..];
    let mut missing = good.clone();
    let at = header_of(&missing, &format!("blobs/sha256/{manifest}"));
    rename(
        &mut missing,
        at,
        &format!("blobs/sha256/{}", "0".repeat(64)),
    );
    let e = open_image(&missing, &name).unwrap_err();
    assert!(e.contains("is not in the archive"), "{e}");

    for bad in ["../oci-lay", "/oci-layou", "a/../b/cde"] {
        let mut escaping = good.clone();
        let at = header_of(&escaping, "oci-layout");
        rename(&mut escaping, at, bad);
        let e = open_image(&escaping, &name).unwrap_err();
        assert!(e.contains("leaves the root"), "{bad}: {e}");
    }
    let mut broken = good.clone();
    let at = header_of(&broken, "oci-layout");
    broken[at] = b'O';
    assert!(open_image(&broken, &name).unwrap_err().contains("checksum"));

    let gateway = open(&archives.gateway, &d.gateway_image());
    let worker = open(&archives.worker, &d.cpu_worker_image());
    type Break = Box<dyn Fn(&mut Image)>;
    let set = |key: &'static str, v: Value| -> Break {
        Box::new(move |i| i.config["config"][key] = v.clone())
    };
    let drop = |prefix: &'static str| -> Break {
        Box::new(move |i| {
            i.layers
                .iter_mut()
                .for_each(|l| l.retain(|e| !e.path.starts_with(prefix)))
        })
    };
    let ledger = d.ledger_dir().trim_start_matches('/').to_string();
    let cases: Vec<(&str, &Image, Break, &str)> = vec![
        (
            "root",
            &gateway,
            set("User", "0:0".into()),
            "not a numeric non-root user",
        ),
        (
            "a named user",
            &worker,
            set("User", "tidegate".into()),
            "not a numeric non-root user",
        ),
        (
            "other arguments",
            &gateway,
            set("Cmd", serde_json::json!(["run"])),
            "is not the Pod's args",
        ),
        (
            "no entrypoint",
            &worker,
            set("Entrypoint", Value::Null),
            "is not one executable file",
        ),
        (
            "a port missing",
            &gateway,
            set("ExposedPorts", serde_json::json!({"9090/tcp": {}})),
            "ExposedPorts",
        ),
        (
            "no mount point",
            &gateway,
            drop("etc/tidegate/tls"),
            "/etc/tidegate/tls (mounted over)",
        ),
        (
            "a ledger folder root's",
            &gateway,
            Box::new(move |i| {
                let all = i.layers.iter_mut().flatten();
                all.filter(|e| e.path == ledger)
                    .for_each(|e| (e.uid, e.gid) = (0, 0));
            }),
            "is not the image user's",
        ),
        (
            "no ONNX Runtime",
            &worker,
            drop("opt/tidegate/onnxruntime"),
            "is not a file of the image",
        ),
        (
            "no glibc copyright",
            &gateway,
            drop("usr/share/doc/libc6"),
            "ships without /usr/share/doc/libc6/copyright",
        ),
        (
            "no tidegate LICENSE",
            &worker,
            drop("usr/share/doc/tidegate"),
            "is not tidegate's LICENSE",
        ),
        (
            "no ONNX Runtime notices",
            &worker,
            drop("usr/share/doc/onnxruntime/ThirdParty"),
            "ThirdPartyNotices.txt is missing",
        ),
        (
            "ONNX Runtime elsewhere",
            &worker,
            set("Env", serde_json::json!(["ORT_DYLIB_PATH=/lib.so"])),
            "ORT_DYLIB_PATH",
        ),
        (
            "no model",
            &worker,
            drop("opt/tidegate/models"),
            "worker.toml serves",
        ),
        (
            "a model not served",
            &worker,
            Box::new(|i| {
                let mut extra = i.layers[1][0].clone();
                extra.path = "opt/tidegate/models/other/model.toml".into();
                i.layers[1].push(extra);
            }),
            "worker.toml serves",
        ),
    ];
    let mut missed = Vec::new();
    for (case, img, break_it, want) in cases {
        let mut broken = Image {
            config: img.config.clone(),
            layers: img.layers.clone(),
        };
        break_it(&mut broken);
        let check = if std::ptr::eq(img, &gateway) {
            check_gateway_image
        } else {
            check_worker_image
        };
        let problems = check(&broken, &d).join("\n");
        if !problems.contains(want) {
            missed.push(format!("{case}: want {want:?} in {problems:?}"));
        }
    }
    assert_ok(missed);
}
