#!/usr/bin/env bash
# `make image`: fnkernel's image (deploy/Dockerfile) built with podman, with no registry and no
# network in the build (docs/kubernetes.md, "The image"). The base is made from this machine's
# Debian release by mmdebstrap (its Python 3), the project's dependencies are wheels built on the
# host first, and the build installs from them alone. Everything podman keeps is under $W, so
# `rm -rf $W` is a clean state. Needs root and Debian's podman, runc and mmdebstrap
# (`make test-k8s` installs them).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
W=${FNKERNEL_PODMAN_DIR:-$ROOT/build/podman}
IMAGE=${IMAGE:-localhost/fnkernel:0.1.0}
BASE=localhost/fnkernel-base:$(. /etc/os-release && echo "$VERSION_CODENAME")
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
export CONTAINERS_CONF=$W/containers.conf CONTAINERS_STORAGE_CONF=$W/storage.conf

mkdir -p "$W"
# runc, not crun (these machines run hybrid cgroups), cgroupfs (no systemd), and ulimits root may
# set here (it lacks CAP_SYS_RESOURCE to raise the defaults).
cat > "$W/containers.conf" <<CONF
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
driver=overlay  # overlay needs $W on a filesystem that is not itself an overlay
if [ "$(stat -f -c %T "$W")" = overlayfs ]; then driver=vfs; fi
cat > "$W/storage.conf" <<CONF
[storage]
driver = "$driver"
runroot = "$W/run"
graphroot = "$W/storage"
CONF

if ! podman image exists "$BASE"; then
    echo "image: the base, $BASE, from Debian's packages (mmdebstrap)"
    mmdebstrap --quiet --variant=minbase \
        --include=python3,python3-venv,python-is-python3,bash,ca-certificates \
        "$(. /etc/os-release && echo "$VERSION_CODENAME")" "$W/rootfs.tar" \
        /etc/apt/sources.list.d/debian.sources
    podman import -q \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' \
        "$W/rootfs.tar" "$BASE" >/dev/null
    rm -f "$W/rootfs.tar"
fi

echo "image: the dependencies, as wheels for the build"
rm -rf "$W/wheels"
"$PYTHON" -m pip wheel --quiet --wheel-dir "$W/wheels" "$ROOT[kubernetes]" 'setuptools>=77' wheel \
    >"$W/wheels.log" 2>&1 || { tail -30 "$W/wheels.log"; exit 1; }
rm -f "$W"/wheels/fnkernel-*.whl
printf '[global]\nno-index = true\nfind-links = /wheels\n' > "$W/pip.conf"

echo "image: $IMAGE from deploy/Dockerfile (no network)"
podman build --quiet --pull=never --network=none --build-arg "BASE=$BASE" \
    -v "$W/wheels:/wheels:ro" -v "$W/pip.conf:/etc/pip.conf:ro" \
    -f "$ROOT/deploy/Dockerfile" -t "$IMAGE" "$ROOT" >/dev/null
podman image inspect --format '{{.Id}} {{.Size}}' "$IMAGE"
