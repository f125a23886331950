#!/usr/bin/env python3
"""Builds tidegate's container images as OCI archives, offline and
reproducibly, from binaries already built. No container runtime, no base
image and no registry: an image is a few JSON files and gzip'd tar layers.

  python3 scripts/image.py --bin-dir target/release --out target/images \\
      [--tag 0.1.0] [--registry ghcr.io/example] [--only gateway|worker|worker-cuda]

writes OUT/tidegate-{gateway,worker}-TAG.oci.tar (and, with --only
worker-cuda, OUT/tidegate-worker-cuda-TAG.oci.tar): an OCI image layout in a
tar (`oci-archive:`, for `podman load`, `skopeo copy` and `docker load`),
with docker-archive's `manifest.json` beside it for a `docker load` that
does not read OCI layouts. Each image holds:
  - the binary (debug info stripped; --no-strip keeps it) as entrypoint,
    and exactly the shared libraries it needs (`ldd`), the dynamic loader
    included, at the paths ldd names;
  - /etc/passwd and /etc/group with the user `tidegate` (65532:65532, the
    runAsUser of deploy/kubernetes/gateway.yaml), which the image runs as,
    and /etc/nsswitch.conf (glibc 2.34+ has the files and dns modules built
    in, so no libnss_*.so is needed);
  - the directories deploy/kubernetes/ mounts over, and /tmp;
  - the licences of what it ships, in /usr/share/doc: tidegate's LICENSE,
    the Debian copyright file of each package a shared library comes from,
    and for the worker ONNX Runtime's LICENSE and ThirdPartyNotices.txt
    (`make setup` puts them beside the library);
  - the worker: ONNX Runtime (libonnxruntime.so and
    libonnxruntime_providers_shared.so, from ORT_DYLIB_PATH or the tidegate
    cache where `make setup` puts them) and the models, both where the
    worker.toml of deploy/kubernetes/worker.yaml looks for them, and only the
    models it serves (`[models] only`).
The CUDA worker (worker-cuda) is the worker for leased GPUs, the image
deploy/kubernetes/gateway.yaml leases: a worker built with the `cuda`
feature, ONNX Runtime's GPU build in place of the CPU one, and in
/opt/tidegate/cuda/lib the CUDA 13 libraries and cuDNN 9 that its CUDA
provider loads (scripts/cuda-libs.sh, pinned wheels) and the NVRTC 12 that
compiles the worker's preprocessing kernel, each with NVIDIA's licence; all
but the driver's libcuda.so.1, which the NVIDIA container toolkit mounts
from the node (NVIDIA_DRIVER_CAPABILITIES and NVIDIA_REQUIRE_CUDA are set).
Every mtime is SOURCE_DATE_EPOCH (default 0), every owner root but the
gateway's ledger folder, entries are sorted and gzip carries no name or
time: the same inputs give the same bytes, and so the same digests.
"""

import argparse
import gzip
import hashlib
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The user both images run as: gateway.yaml's securityContext (runAsUser,
# runAsGroup, fsGroup). Numeric in the config, so that the kubelet can
# check runAsNonRoot.
UID = GID = 65532
USER = "tidegate"

# The gateway's layout: its Deployment in deploy/kubernetes/gateway.yaml
# (args, volumeMounts, ports). deploy/tests/container_images.rs checks
# that the two agree.
GATEWAY_CONFIG = "/etc/tidegate/gateway/gateway.toml"
GATEWAY_MOUNTS = ["/etc/tidegate/gateway", "/etc/tidegate/tls"]
GATEWAY_LEDGER_DIR = "/var/lib/tidegate"
GATEWAY_PORTS = ["4433/udp", "9090/tcp"]

# Where deploy/kubernetes/worker.yaml's ConfigMap is mounted, and the
# worker's arguments ([leasing.kubernetes] mounts and args in gateway.yaml).
WORKER_CONFIG = "/etc/tidegate/worker/worker.toml"
WORKER_MOUNTS = ["/etc/tidegate/worker", "/etc/tidegate/ca"]
WORKER_HOME = "/opt/tidegate"

# The CUDA worker image: where its CUDA libraries go, the driver libraries
# the node provides, and a string only a worker built with the `cuda`
# feature holds (its GPU kernel, cloud-worker/src/gpu.rs).
CUDA_HOME = f"{WORKER_HOME}/cuda"
DRIVER_LIBRARIES = frozenset({"libcuda.so.1"})
CUDA_KERNEL_MARKER = b'extern "C" __global__ void tidegate_preprocess('

BIN = "/usr/local/bin"
DOC = "/usr/share/doc"
PATH_ENV = "PATH=/usr/local/bin:/usr/bin:/bin"

# ELF e_machine values, with the machine names `uname -m` and OCI use.
MACHINES = {62: ("x86_64", "amd64"), 183: ("aarch64", "arm64")}

MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


class BuildError(Exception):
    """What stops a build, said so that the reader knows what to do."""


def fail(message: str):
    sys.exit(f"image.py: error: {message}")


# ----------------------------------------------------------------- inputs


def workspace() -> dict:
    """The root Cargo.toml's [workspace.package]."""
    with open(ROOT / "Cargo.toml", "rb") as f:
        return tomllib.load(f)["workspace"]["package"]


def crate_description(crate_dir: str) -> str:
    with open(ROOT / crate_dir / "Cargo.toml", "rb") as f:
        return tomllib.load(f)["package"].get("description", "")


def git_revision() -> str | None:
    """HEAD's commit, if this is a git checkout and git is installed."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                             capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def configmap_file(manifest: Path, key: str) -> str:
    """The text of `key: |` (a literal block) in a ConfigMap's data: the
    lines below it indented deeper than the key, dedented."""
    lines = manifest.read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)" + re.escape(key) + r":\s*\|\s*$", line)
        if not m:
            continue
        block, indent = [], None
        for body in lines[i + 1:]:
            if body.strip() and len(body) - len(body.lstrip()) <= len(m.group(1)):
                break
            if indent is None and body.strip():
                indent = len(body) - len(body.lstrip())
            block.append(body[indent or 0:])
        return "\n".join(block).rstrip() + "\n"
    raise BuildError(f"{manifest.relative_to(ROOT)} has no `{key}: |` block")


def worker_toml() -> dict:
    """deploy/kubernetes/worker.yaml's worker.toml."""
    path = ROOT / "deploy/kubernetes/worker.yaml"
    try:
        return tomllib.loads(configmap_file(path, "worker.toml"))
    except tomllib.TOMLDecodeError as e:
        raise BuildError(f"the worker.toml in {path.relative_to(ROOT)} is not TOML: {e}")


def ort_version() -> str:
    """The ONNX Runtime release the worker is built for (runtime.rs)."""
    src = (ROOT / "cloud-worker/src/runtime.rs").read_text()
    m = re.search(r'pub const ORT_VERSION: &str = "([^"]+)";', src)
    if not m:
        raise BuildError("ORT_VERSION not found in cloud-worker/src/runtime.rs")
    return m.group(1)


def cache_dir() -> Path:
    """Where make setup keeps its downloads, as scripts/cache.sh and the
    worker (cloud-worker/src/runtime.rs) find it."""
    env = lambda name: os.environ.get(name) or None  # noqa: E731
    cache = (env("TIDEGATE_CACHE")
             or (env("XDG_CACHE_HOME") and os.path.join(env("XDG_CACHE_HOME"), "tidegate"))
             or (env("HOME") and os.path.join(env("HOME"), ".cache", "tidegate")))
    if not cache:
        raise BuildError("no tidegate cache (TIDEGATE_CACHE, XDG_CACHE_HOME and HOME unset); "
                         "run `make setup`, or pass the libraries' paths")
    return Path(cache)


def ort_library(explicit: str | None) -> Path:
    """libonnxruntime.so: --onnxruntime, else ORT_DYLIB_PATH, else the
    tidegate cache, as the worker itself looks (cloud-worker/src/runtime.rs)."""
    env = lambda name: os.environ.get(name) or None  # noqa: E731
    if explicit or env("ORT_DYLIB_PATH"):
        path = Path(explicit or env("ORT_DYLIB_PATH"))
        origin = "--onnxruntime" if explicit else "ORT_DYLIB_PATH"
    else:
        path = cache_dir() / "onnxruntime" / ort_version() / "libonnxruntime.so"
        origin = "the tidegate cache"
    if not path.is_file():
        raise BuildError(f"ONNX Runtime not found at {path} ({origin}); run `make setup`, "
                         f"or pass --onnxruntime PATH/libonnxruntime.so")
    return path


def binary(bin_dir: Path, name: str, package: str) -> Path:
    path = bin_dir / name
    if not path.is_file():
        how = {"release": f"cargo build --release -p {package} (or make release)",
               "debug": f"cargo build -p {package}"}.get(
            bin_dir.name, f"cargo build --release -p {package} and pass its folder to --bin-dir")
        raise BuildError(f"{path} not found; build it first: {how}")
    return path


def elf_machine(path: Path) -> int:
    """The ELF e_machine of `path`, which must be a 64-bit little-endian ELF."""
    with open(path, "rb") as f:
        head = f.read(20)
    if len(head) < 20 or head[:4] != b"\x7fELF":
        raise BuildError(f"{path} is not an ELF file")
    if head[4] != 2 or head[5] != 1:
        raise BuildError(f"{path} is not a 64-bit little-endian ELF file")
    return int.from_bytes(head[18:20], "little")


def check_arch(path: Path) -> str:
    """The OCI architecture of `path`, which must be this machine's: the
    libraries put beside it come from this machine."""
    here = platform.machine()
    machine = elf_machine(path)
    name, oci = MACHINES.get(machine, (f"ELF machine {machine}", None))
    if name != here:
        raise BuildError(f"{path} is built for {name}, but this machine is {here} and its "
                         f"shared libraries go into the image; build the image on {name}, "
                         f"or build the binary for {here}")
    return oci


def shared_libraries(path: Path, search: list[Path] = (), absent: frozenset = frozenset()
                     ) -> list[str]:
    """The absolute paths of the libraries `path` loads (the dynamic loader
    included), as ldd reports them, with the folders `search` on the library
    path; none for a static binary. Only the sonames in `absent` may be
    missing (they are the host's, mounted into the container at run time)."""
    env = dict(os.environ)
    if search:
        env["LD_LIBRARY_PATH"] = ":".join(str(d) for d in search)
    out = subprocess.run(["ldd", str(path)], capture_output=True, text=True, env=env)
    text = out.stdout + out.stderr
    if "not a dynamic executable" in text or "statically linked" in text:
        return []
    if out.returncode != 0:
        raise BuildError(f"ldd {path} failed: {text.strip()}")
    missing = [line.split()[0] for line in text.splitlines()
               if "=> not found" in line and line.split()[0] not in absent]
    if missing:
        raise BuildError(f"{path} needs {', '.join(missing)}, which this machine does not "
                         f"have (ldd says not found); install them and build again")
    libs = []
    for line in text.splitlines():
        m = re.match(r"^\s*(?:\S+ => )?(/\S+) \(0x[0-9a-f]+\)$", line)
        if m:
            libs.append(m.group(1))
    return libs


# ------------------------------------------------------------------ layers


class Entry:
    """One file, directory or symlink of a layer."""

    def __init__(self, path, *, mode=0o644, uid=0, gid=0, data=None, source=None, link=None):
        self.path = path.strip("/")
        self.mode, self.uid, self.gid = mode, uid, gid
        self.data, self.source, self.link = data, source, link

    @staticmethod
    def dir(path, mode=0o755, uid=0, gid=0):
        return Entry(path, mode=mode, uid=uid, gid=gid)

    def is_dir(self):
        return self.data is None and self.source is None and self.link is None


def with_parents(entries: list[Entry]) -> list[Entry]:
    """`entries`, with a root-owned 0755 entry for every parent directory
    not listed, sorted by path (a parent before its children)."""
    by_path = {e.path: e for e in entries}
    for e in entries:
        parts = e.path.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            by_path.setdefault("/".join(parts[:i]), Entry.dir("/".join(parts[:i])))
    return [by_path[p] for p in sorted(by_path)]


class Hashing:
    """A write-only file that counts and hashes what passes through it."""

    def __init__(self, out):
        self.out, self.size, self.sha = out, 0, hashlib.sha256()

    def write(self, b):
        self.sha.update(b)
        self.size += len(b)
        return self.out.write(b)

    def flush(self):
        pass

    def digest(self):
        return "sha256:" + self.sha.hexdigest()


def tar_info(name: str, mtime: int, **kw) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.mtime, info.uname, info.gname = mtime, "", ""
    for k, v in kw.items():
        setattr(info, k, v)
    return info


def write_layer(entries: list[Entry], blob_dir: Path, mtime: int, level: int) -> dict:
    """Writes the layer's gzip'd tar into blob_dir under its digest; returns
    its descriptor, with the uncompressed digest (diff_id) beside it."""
    tmp = blob_dir / "layer.tmp"
    with open(tmp, "wb") as raw:
        packed = Hashing(raw)
        with gzip.GzipFile(filename="", mode="wb", fileobj=packed, mtime=0, compresslevel=level) as gz:
            plain = Hashing(gz)
            with tarfile.open(fileobj=plain, mode="w|", format=tarfile.USTAR_FORMAT) as tar:
                for e in with_parents(entries):
                    common = dict(mode=e.mode, uid=e.uid, gid=e.gid)
                    if e.is_dir():
                        tar.addfile(tar_info(e.path, mtime, type=tarfile.DIRTYPE, **common))
                    elif e.link is not None:
                        tar.addfile(tar_info(e.path, mtime, type=tarfile.SYMTYPE,
                                             linkname=e.link, mode=0o777, uid=e.uid, gid=e.gid))
                    elif e.data is not None:
                        info = tar_info(e.path, mtime, size=len(e.data), **common)
                        tar.addfile(info, io.BytesIO(e.data))
                    else:
                        info = tar_info(e.path, mtime, size=os.path.getsize(e.source), **common)
                        with open(e.source, "rb") as f:
                            tar.addfile(info, f)
    digest = packed.digest()
    tmp.rename(blob_dir / digest.split(":")[1])
    return {"mediaType": MEDIA_LAYER, "digest": digest, "size": packed.size,
            "diff_id": plain.digest(), "unpacked": plain.size}


def write_blob(blob_dir: Path, data: bytes, media_type: str) -> dict:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    (blob_dir / digest.split(":")[1]).write_bytes(data)
    return {"mediaType": media_type, "digest": digest, "size": len(data)}


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


# ------------------------------------------------------------------ images


def owning_package(path: str) -> str:
    """The Debian package that installed `path` (under either spelling of a
    merged /usr)."""
    spellings = [path, path[len("/usr"):] if path.startswith("/usr/") else "/usr" + path]
    for p in spellings:
        try:
            out = subprocess.run(["dpkg-query", "-S", p], capture_output=True, text=True)
        except FileNotFoundError:
            raise BuildError("dpkg-query is missing: the images take their shared libraries' "
                             "copyright files from Debian's package database; build them on "
                             "Debian or Ubuntu") from None
        if out.returncode == 0:
            # "libc6:amd64: /lib/x86_64-linux-gnu/libc.so.6"
            return out.stdout.splitlines()[0].split(": ")[0].split(":")[0]
    raise BuildError(f"no Debian package owns {path}, so its licence is unknown; "
                     f"install it from a package, or keep it out of the image")


def library_licences(libs: list[str]) -> list[Entry]:
    """The copyright file of each Debian package the libraries come from."""
    entries = {}
    for lib in libs:
        pkg = owning_package(lib)
        copyright_file = Path(DOC) / pkg / "copyright"
        if not copyright_file.is_file():
            raise BuildError(f"{copyright_file} (the licence of {lib}) is missing; "
                             f"reinstall {pkg} without excluding /usr/share/doc")
        entries[pkg] = Entry(str(copyright_file), source=copyright_file)
    return [entries[p] for p in sorted(entries)]


def system_libraries(binaries: list[Path]) -> list[str]:
    """The loader and shared libraries `binaries` load from this system."""
    return sorted({lib for b in binaries for lib in shared_libraries(b)})


def system_layer(libs: list[str], dirs: list[Entry]) -> list[Entry]:
    """The loader and system libraries `libs` with their packages' copyright
    files, tidegate's licence, the user, NSS, and the image's directories."""
    entries = [Entry(lib, mode=0o755, source=os.path.realpath(lib)) for lib in libs]
    entries += library_licences(libs)
    entries.append(Entry(f"{DOC}/tidegate/LICENSE", source=ROOT / "LICENSE"))
    entries += [
        Entry("/etc/passwd", data=(f"root:x:0:0:root:/root:/sbin/nologin\n"
                                   f"{USER}:x:{UID}:{GID}:{USER}:/nonexistent:/sbin/nologin\n"
                                   ).encode()),
        Entry("/etc/group", data=f"root:x:0:\n{USER}:x:{GID}:\n".encode()),
        # glibc 2.34+ has `files` and `dns` built in: nothing is dlopen'ed.
        Entry("/etc/nsswitch.conf", data=b"passwd: files\ngroup: files\nhosts: files dns\n"),
        Entry.dir("/tmp", mode=0o1777),
    ]
    return entries + dirs


def stripped(path: Path, scratch: Path, strip: bool) -> Path:
    if not strip:
        return path
    out = scratch / path.name
    try:
        subprocess.run(["objcopy", "--strip-debug", str(path), str(out)], check=True,
                       capture_output=True, text=True)
    except FileNotFoundError:
        raise BuildError("objcopy not found; install binutils (apt-get install binutils), "
                         "or pass --no-strip")
    except subprocess.CalledProcessError as e:
        raise BuildError(f"objcopy --strip-debug {path} failed: {e.stderr.strip()}")
    return out


def model_entries(models_dir: Path, image_dir: str, only: list[str]) -> list[Entry]:
    """model.toml, its ONNX file and FP16 variant (sha256 checked) and LICENSE.model of each
    model in `only` (every model in models_dir when empty)."""
    names = only or sorted(p.parent.name for p in models_dir.glob("*/model.toml"))
    if not names:
        raise BuildError(f"no model in {models_dir}; run `make setup`")
    entries = []
    for name in names:
        folder = models_dir / name
        try:
            with open(folder / "model.toml", "rb") as f:
                spec = tomllib.load(f)
        except FileNotFoundError:
            raise BuildError(f"{folder}/model.toml not found: the worker config serves "
                             f"{name!r}; check [models] only")
        onnx = folder / spec["file"]
        if not onnx.is_file():
            raise BuildError(f"{onnx} is missing; run `make setup`")
        want = spec.get("sha256")
        if want and hashlib.sha256(onnx.read_bytes()).hexdigest() != want:
            raise BuildError(f"{onnx} does not match the sha256 in its model.toml; "
                             f"run `make setup` to fetch it again")
        dest = f"{image_dir}/{name}"
        entries += [Entry(f"{dest}/model.toml", source=folder / "model.toml"),
                    Entry(f"{dest}/{spec['file']}", source=onnx)]
        # The FP16 variant (runtime.precision = "fp16"), when the model has one.
        variant = spec.get("fp16")
        if variant:
            half = folder / variant["file"]
            if not half.is_file():
                raise BuildError(f"{half} is missing; run `make setup`")
            if hashlib.sha256(half.read_bytes()).hexdigest() != variant["sha256"]:
                raise BuildError(f"{half} does not match the [fp16] sha256 in its model.toml; "
                                 f"run `make setup` to build it again")
            entries.append(Entry(f"{dest}/{variant['file']}", source=half))
        if (folder / "LICENSE.model").is_file():
            entries.append(Entry(f"{dest}/LICENSE.model", source=folder / "LICENSE.model"))
    return entries


def ort_entries(library: Path, image_path: str) -> list[Entry]:
    """libonnxruntime.so at `image_path` (a symlink to its versioned file, if
    it is one here) and the provider libraries beside it
    (libonnxruntime_providers_*.so)."""
    dest = os.path.dirname(image_path)
    real = Path(os.path.realpath(library))
    entries = [Entry(f"{dest}/{real.name}", mode=0o755, source=real)]
    if real.name != os.path.basename(image_path):
        entries.append(Entry(image_path, link=real.name))
    # The providers' libraries: shared in every build, cuda in the GPU build.
    for provider in sorted(library.parent.glob("libonnxruntime_providers_*.so")):
        entries.append(Entry(f"{dest}/{provider.name}", mode=0o755,
                             source=os.path.realpath(provider)))
    notices = [real.parent / n for n in ("LICENSE", "ThirdPartyNotices.txt")]
    missing = [str(n) for n in notices if not n.is_file()]
    if missing:
        raise BuildError(f"ONNX Runtime's licence files are missing ({', '.join(missing)}); "
                         f"the image must carry them: run 'make setup', or put them beside "
                         f"your library")
    entries += [Entry(f"{DOC}/onnxruntime/{n.name}", source=n) for n in notices]
    return entries


def gateway_image(args, scratch: Path) -> dict:
    exe = binary(args.bin_dir, "tidegate-gateway", "tidegate-gateway")
    arch = check_arch(exe)
    dirs = [Entry.dir(d) for d in GATEWAY_MOUNTS]
    # The ledger's volume: writable by the gateway when run without one.
    dirs.append(Entry.dir(GATEWAY_LEDGER_DIR, mode=0o750, uid=UID, gid=GID))
    return {
        "name": "tidegate-gateway",
        "arch": arch,
        "description": crate_description("gateway"),
        "layers": [
            ("the loader, shared libraries, user and directories",
             system_layer(system_libraries([exe]), dirs)),
            ("tidegate-gateway", [Entry(f"{BIN}/tidegate-gateway", mode=0o755,
                                        source=stripped(exe, scratch, args.strip))]),
        ],
        "config": {
            "User": f"{UID}:{GID}",
            "Entrypoint": [f"{BIN}/tidegate-gateway"],
            "Cmd": ["--config", GATEWAY_CONFIG, "run"],
            "Env": [PATH_ENV],
            "WorkingDir": GATEWAY_LEDGER_DIR,
            "ExposedPorts": {p: {} for p in GATEWAY_PORTS},
        },
    }


def worker_layout() -> tuple[str, str, list[str]]:
    """Where deploy/kubernetes/worker.yaml's worker.toml looks for ONNX
    Runtime and the models, and which models it serves."""
    cfg = worker_toml()
    runtime, models = cfg.get("runtime", {}), cfg.get("models", {})
    lib_path = runtime.get("library") or f"{WORKER_HOME}/onnxruntime/libonnxruntime.so"
    models_path = models.get("dir", f"{WORKER_HOME}/models")
    if not (lib_path.startswith("/") and models_path.startswith("/")):
        raise BuildError("deploy/kubernetes/worker.yaml's worker.toml must give absolute "
                         "runtime.library and models.dir paths: they are the image's layout")
    return lib_path, models_path, models.get("only", [])


def worker_parts(args, exe: Path, ort: Path) -> tuple[str, str, list[Entry], list[Entry]]:
    """What both worker images hold around the binary `exe` and ONNX Runtime
    `ort`: their architecture (which must be one), runtime.library's path,
    ONNX Runtime and the models at worker.yaml's paths, and the mounted
    directories."""
    arch = check_arch(exe)
    if check_arch(ort) != arch:
        raise BuildError(f"{ort} and {exe} are built for different machines")
    lib_path, models_path, only = worker_layout()
    shipped = (ort_entries(ort, lib_path)
               + model_entries(args.models_dir, models_path, only))
    return arch, lib_path, shipped, [Entry.dir(d) for d in WORKER_MOUNTS]


def worker_image(args, scratch: Path) -> dict:
    exe = binary(args.bin_dir, "tidegate-worker", "tidegate-worker")
    ort = ort_library(args.onnxruntime)
    arch, lib_path, shipped, dirs = worker_parts(args, exe, ort)
    return {
        "name": "tidegate-worker",
        "arch": arch,
        "description": crate_description("cloud-worker") + " (ONNX Runtime's CPU build)",
        "layers": [
            ("the loader, shared libraries, user and directories",
             system_layer(system_libraries([exe, ort]), dirs)),
            ("ONNX Runtime and the models", shipped),
            worker_layer("tidegate-worker", exe, scratch, args),
        ],
        "config": worker_config(lib_path, []),
    }


def worker_layer(what: str, exe: Path, scratch: Path, args) -> tuple[str, list[Entry]]:
    """The worker's binary, the image's last layer."""
    return (what, [Entry(f"{BIN}/tidegate-worker", mode=0o755,
                         source=stripped(exe, scratch, args.strip))])


def worker_config(lib_path: str, env: list[str]) -> dict:
    """A worker image's runtime settings, with `env` after PATH and
    ORT_DYLIB_PATH (the worker config's runtime.library wins; that is for a
    config without one)."""
    return {
        "User": f"{UID}:{GID}",
        "Entrypoint": [f"{BIN}/tidegate-worker"],
        "Cmd": ["--config", WORKER_CONFIG],
        "Env": [PATH_ENV, f"ORT_DYLIB_PATH={lib_path}"] + env,
        "WorkingDir": WORKER_HOME,
    }


def cuda_libs_dir(explicit: Path | None) -> Path:
    """scripts/cuda-libs.sh's folder: ONNX Runtime's GPU build (of the
    release the worker is built for) and the CUDA libraries."""
    path = explicit or cache_dir() / "cuda-libs" / f"onnxruntime-gpu-{ort_version()}"
    if not (path / "complete").is_file():
        raise BuildError(f"ONNX Runtime's GPU build and the CUDA libraries are not in {path}; "
                         f"run `bash scripts/setup.sh --cuda` (or scripts/cuda-libs.sh)")
    return path


def nvrtc_files(explicit: Path | None) -> tuple[list[Path], Path]:
    """The pinned NVRTC the worker compiles its kernel with (make setup):
    its library and builtins (which it loads by name), and its licence."""
    src = (ROOT / "scripts/setup.sh").read_text()
    m = re.search(r"^NVRTC_VERSION=(\S+)$", src, re.M)
    if not m:
        raise BuildError("NVRTC_VERSION not found in scripts/setup.sh")
    version = m.group(1)
    path = explicit or cache_dir() / "cuda-nvrtc" / version
    libs = [path / "libnvrtc.so.12", path / f"libnvrtc-builtins.so.{version.rsplit('.', 1)[0]}"]
    missing = [p.name for p in libs + [path / "License.txt"] if not p.is_file()]
    if missing:
        raise BuildError(f"NVRTC {version} is incomplete in {path} (no {', '.join(missing)}); "
                         f"run `make setup`")
    return libs, path / "License.txt"


def worker_cuda_image(args, scratch: Path) -> dict:
    """The worker for leased GPUs: built with the `cuda` feature, ONNX
    Runtime's GPU build, and every library its CUDA provider and the GPU
    preprocessing load, but the driver's (libcuda.so.1), which the NVIDIA
    container toolkit (or Kubernetes' device plugin) mounts from the node."""
    exe = binary(args.bin_dir, "tidegate-worker", "tidegate-worker")
    with open(exe, "rb") as f:
        if CUDA_KERNEL_MARKER not in f.read():
            release = "--release " if args.bin_dir.name == "release" else ""
            raise BuildError(f"{exe} was built without the `cuda` feature (no GPU kernel in it); "
                             f"cargo build {release}-p tidegate-worker --features cuda "
                             f"(make images-cuda does; make test builds with --all-features)")
    cuda = cuda_libs_dir(args.cuda_libs)
    nvrtc, nvrtc_licence = nvrtc_files(args.nvrtc)
    ort = cuda / "onnxruntime" / "libonnxruntime.so"
    arch, lib_path, shipped, dirs = worker_parts(args, exe, ort)
    libs = sorted(p for p in (cuda / "lib").iterdir() if ".so" in p.name) + nvrtc
    here = [cuda / "lib", cuda / "onnxruntime", nvrtc[0].parent]
    # What they all load from this system (libstdc++, zlib, …); the driver's
    # library is the node's.
    system = set(system_libraries([exe, ort]))
    for lib in libs + sorted((cuda / "onnxruntime").glob("libonnxruntime_providers_*.so")):
        for dep in shared_libraries(lib, here, DRIVER_LIBRARIES):
            if not any(Path(dep).is_relative_to(d) for d in here):
                system.add(dep)
    lib_dir = f"{CUDA_HOME}/lib"
    cuda_layer = [Entry(f"{lib_dir}/{p.name}", mode=0o755, source=p) for p in libs]
    for pkg in sorted(p.name for p in (cuda / "licenses").iterdir()):
        cuda_layer.append(Entry(f"{DOC}/{pkg}/License.txt",
                                source=cuda / "licenses" / pkg / "License.txt"))
    cuda_layer.append(Entry(f"{DOC}/nvidia-cuda-nvrtc-cu12/License.txt",
                            source=nvrtc_licence))
    return {
        "name": "tidegate-worker-cuda",
        "arch": arch,
        "description": crate_description("cloud-worker")
        + " (ONNX Runtime's GPU build, CUDA 13, cuDNN 9)",
        "layers": [
            ("the loader, shared libraries, user and directories",
             system_layer(sorted(system), dirs)),
            # Apart, so that a new worker reuses the big layer.
            ("the CUDA 13 libraries, cuDNN 9 and NVRTC", cuda_layer),
            ("ONNX Runtime's GPU build and the models", shipped),
            worker_layer("tidegate-worker (cuda)", exe, scratch, args),
        ],
        "config": worker_config(lib_path, [
            f"LD_LIBRARY_PATH={lib_dir}:{os.path.dirname(lib_path)}",
            # What the NVIDIA container toolkit mounts and checks: the
            # driver's compute libraries, and one new enough for CUDA 13 (a
            # clear refusal at start otherwise).
            "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
            "NVIDIA_REQUIRE_CUDA=cuda>=13.0"]),
    }


def build(spec: dict, args) -> dict:
    """Writes spec's image as OUT/NAME-TAG.oci.tar; returns what to print."""
    epoch = args.epoch
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))
    ref = f"{args.registry}/{spec['name']}:{args.tag}"
    pkg = workspace()
    labels = {
        "org.opencontainers.image.title": spec["name"],
        "org.opencontainers.image.description": spec["description"],
        "org.opencontainers.image.version": pkg["version"],
        "org.opencontainers.image.source": pkg["repository"],
        "org.opencontainers.image.licenses": pkg["license"],
        "org.opencontainers.image.created": created,
    }
    revision = git_revision()
    if revision:
        labels["org.opencontainers.image.revision"] = revision
    work = Path(tempfile.mkdtemp(prefix=f".{spec['name']}-", dir=args.out))
    try:
        blobs = work / "blobs" / "sha256"
        blobs.mkdir(parents=True)
        layers = [write_layer(entries, blobs, epoch, args.compress_level)
                  for _, entries in spec["layers"]]
        config = {
            "created": created,
            "architecture": spec["arch"],
            "os": "linux",
            "config": dict(spec["config"], Labels=labels),
            "rootfs": {"type": "layers", "diff_ids": [l["diff_id"] for l in layers]},
            "history": [{"created": created, "created_by": f"scripts/image.py: {what}"}
                        for what, _ in spec["layers"]],
        }
        config_desc = write_blob(blobs, canonical(config), MEDIA_CONFIG)
        manifest = {
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": config_desc,
            "layers": [{k: l[k] for k in ("mediaType", "digest", "size")} for l in layers],
            "annotations": {"org.opencontainers.image.created": created},
        }
        manifest_desc = write_blob(blobs, canonical(manifest), MEDIA_MANIFEST)
        index = {
            "schemaVersion": 2,
            "mediaType": MEDIA_INDEX,
            "manifests": [dict(manifest_desc,
                               platform={"architecture": spec["arch"], "os": "linux"},
                               annotations={"org.opencontainers.image.ref.name": ref,
                                            "io.containerd.image.name": ref})],
        }
        # docker-archive's manifest, for a `docker load` that reads no OCI layout.
        legacy = [{"Config": f"blobs/sha256/{config_desc['digest'][7:]}",
                   "RepoTags": [ref],
                   "Layers": [f"blobs/sha256/{l['digest'][7:]}" for l in layers]}]
        files = {
            "oci-layout": canonical({"imageLayoutVersion": "1.0.0"}),
            "index.json": canonical(index),
            "manifest.json": canonical(legacy),
        }
        out = args.out / f"{spec['name']}-{args.tag}.oci.tar"
        partial = work / "image.tar"
        with tarfile.open(partial, "w", format=tarfile.USTAR_FORMAT) as tar:
            blob_names = [f"blobs/sha256/{p.name}" for p in blobs.iterdir()]
            names = sorted(["blobs", "blobs/sha256"] + blob_names + list(files))
            for name in names:
                if name in ("blobs", "blobs/sha256"):
                    tar.addfile(tar_info(name, epoch, type=tarfile.DIRTYPE, mode=0o755))
                elif name in files:
                    tar.addfile(tar_info(name, epoch, size=len(files[name]), mode=0o644),
                                io.BytesIO(files[name]))
                else:
                    path = work / name
                    with open(path, "rb") as f:
                        tar.addfile(tar_info(name, epoch, size=path.stat().st_size, mode=0o644), f)
        partial.replace(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"name": spec["name"], "ref": ref, "path": out, "digest": manifest_desc["digest"],
            "size": sum(l["size"] for l in layers) + config_desc["size"] + manifest_desc["size"],
            "unpacked": sum(l["unpacked"] for l in layers)}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin-dir", type=Path, default=ROOT / "target/release",
                   help="folder of tidegate-gateway and tidegate-worker (default: target/release)")
    p.add_argument("--out", type=Path, default=ROOT / "target/images",
                   help="where to write NAME-TAG.oci.tar (default: target/images)")
    p.add_argument("--tag", help="image tag (default: the workspace version)")
    p.add_argument("--registry", default="ghcr.io/example",
                   help="registry and namespace of the image names (default: ghcr.io/example, "
                        "as deploy/kubernetes/ names them)")
    p.add_argument("--only", choices=["gateway", "worker", "worker-cuda"],
                   help="build one image (default: gateway and worker; worker-cuda, the "
                        "worker for GPUs, only when asked for)")
    p.add_argument("--onnxruntime", help="libonnxruntime.so for the worker (default: "
                                         "ORT_DYLIB_PATH, then the tidegate cache)")
    p.add_argument("--models-dir", type=Path, default=ROOT / "models",
                   help="the model repository (default: models/)")
    p.add_argument("--cuda-libs", type=Path,
                   help="for worker-cuda: scripts/cuda-libs.sh's folder (default: in the "
                        "tidegate cache)")
    p.add_argument("--nvrtc", type=Path,
                   help="for worker-cuda: the folder of NVRTC 12 (libnvrtc.so.12, its builtins "
                        "and License.txt; default: in the tidegate cache)")
    p.add_argument("--no-strip", dest="strip", action="store_false",
                   help="keep the binaries' debug info")
    p.add_argument("--compress-level", type=int, default=6, choices=range(1, 10),
                   metavar="1-9", help="gzip level of the layers (default 6; the same level "
                                       "gives the same bytes)")
    args = p.parse_args(argv)
    args.tag = args.tag or workspace()["version"]
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", args.tag):
        p.error(f"--tag {args.tag!r} is not a valid image tag")
    epoch = os.environ.get("SOURCE_DATE_EPOCH", "0")
    if not epoch.isdigit():
        p.error(f"SOURCE_DATE_EPOCH={epoch!r} is not a whole number of seconds")
    args.epoch = int(epoch)
    return args


def main(argv=None):
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    wanted = [args.only] if args.only else ["gateway", "worker"]
    makers = {"gateway": gateway_image, "worker": worker_image,
              "worker-cuda": worker_cuda_image}
    try:
        with tempfile.TemporaryDirectory(prefix=".strip-", dir=args.out) as scratch:
            for kind in wanted:
                r = build(makers[kind](args, Path(scratch)), args)
                print(f"{r['name']}: {r['path']}\n  {r['ref']}@{r['digest']}\n"
                      f"  {r['size'] / 1e6:.1f} MB compressed, "
                      f"{r['unpacked'] / 1e6:.1f} MB unpacked", flush=True)
    except BuildError as e:
        fail(str(e))


if __name__ == "__main__":
    main()
