"""A third-party plugin, installed at test time, extends the sampler pipeline.

The test writes a real importable package plus a `.dist-info` whose entry_points.txt
names it in the `exl3cli` group, exactly what `pip install` of a plugin leaves behind;
importlib.metadata finds it on sys.path and pluggy loads it.
"""

import sys
import textwrap

import pytest
import torch

from exl3cli.engine.generation.sampling import build_sampler
from exl3cli.hookspecs import reset_plugin_manager

PLUGIN_MODULE = '''
import torch

from exl3cli.engine.generation.sampling import ParamSpec, SamplerStep
from exl3cli.hookspecs import hookimpl


class BanTokenStep(SamplerStep):
    name = "ban_token"
    order = 5
    params = {"ban_token": ParamSpec(int, -1, minimum=-1, help="token id never sampled")}

    def apply(self, logits, ctx):
        banned = ctx.options["ban_token"]
        if 0 <= banned < logits.numel():
            logits[banned] = float("-inf")
        return logits


@hookimpl
def exl3_samplers():
    return [BanTokenStep()]
'''


def install_plugin(site, monkeypatch, package="exl3_ban_plugin"):
    (site / f"{package}.py").write_text(PLUGIN_MODULE)
    dist_info = site / f"{package}-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(
        textwrap.dedent(f"""\
            [exl3cli]
            ban = {package}
            """)
    )
    monkeypatch.syspath_prepend(str(site))
    reset_plugin_manager()


@pytest.fixture
def plugin_site(tmp_path, monkeypatch):
    yield tmp_path
    # Undo for later tests: sys.path is restored by monkeypatch, then the cache cleared.
    monkeypatch.undo()
    sys.modules.pop("exl3_ban_plugin", None)  # the next test imports a fresh copy
    reset_plugin_manager()


def test_third_party_sampler_step_is_used(plugin_site, monkeypatch):
    logits = torch.tensor([5.0, 1.0, 0.0])
    assert "ban_token" in build_sampler({"ban_token": 0}).unknown_options

    install_plugin(plugin_site, monkeypatch)
    sampler = build_sampler({"temperature": 0, "ban_token": 0})
    assert "ban_token" not in sampler.unknown_options
    assert [step.name for step in sampler.steps][0] == "ban_token"  # order 5: first
    assert sampler.sample(logits, []) == 1  # the argmax token is banned
    assert build_sampler({"temperature": 0}).sample(logits, []) == 0  # default: off


def test_plugin_is_gone_after_reset(plugin_site, monkeypatch):
    install_plugin(plugin_site, monkeypatch)
    assert any(s.name == "ban_token" for s in build_sampler({}).steps)
    monkeypatch.undo()
    reset_plugin_manager()
    assert all(s.name != "ban_token" for s in build_sampler({}).steps)
    assert build_sampler({"temperature": 0, "ban_token": 0}).sample(
        torch.tensor([5.0, 1.0, 0.0]), []
    ) == 0
