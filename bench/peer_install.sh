# Sourced by the bench/gpu_*.sh scripts: ExLlamaV3 1.6.5 from the carried .whl/ (its
# wheels and its prebuilt extension *.so.xz, shared/tools/README.md) into /tmp/peer.
#   peer_wheels    true when .whl/ holds the peer's wheel
#   peer_install   install it; prints "peer install ok", fails when a step fails
peer_wheels() { ls .whl/exllamav3-*.whl >/dev/null 2>&1; }
peer_install() {
  python3 -m pip install -q --no-index --no-deps --target /tmp/peer .whl/*.whl \
    && xz -dc .whl/*.so.xz >/tmp/peer/exllamav3_ext.so && echo "peer install ok"
}
