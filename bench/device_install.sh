# Sourced by the GPU-machine scripts: make `exl3cli` and its built-in plugins importable
# there without a package index. An editable install when setuptools allows it; else a
# hand-made dist-info carrying the entry points, with the sources on PYTHONPATH.
if ! python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1; then
    mkdir -p /tmp/site/exl3-0.1.0.dist-info
    ln -sfn "$PWD/plugins" /tmp/site/exl3_plugins
    printf 'Metadata-Version: 2.1\nName: exl3\nVersion: 0.1.0\n' \
        > /tmp/site/exl3-0.1.0.dist-info/METADATA
    printf '[exl3cli]\narchitectures = exl3_plugins.architectures\nsamplers = exl3_plugins.samplers\ndrafters = exl3_plugins.drafters\nsources = exl3_plugins.sources\n' \
        > /tmp/site/exl3-0.1.0.dist-info/entry_points.txt
    export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    echo "note: editable install unavailable; using PYTHONPATH and a hand-made dist-info"
fi
python3 -c "from exl3cli.engine.spec.architecture import available_architectures as a; print('architectures:', a())" \
    || echo "FAIL: exl3cli not importable"
