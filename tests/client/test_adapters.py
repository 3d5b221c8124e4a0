"""Modelfile ADAPTER end to end in-process: create stores the adapter with the model,
show lists it, requests on models that differ only in ADAPTER share one loaded base and
run in one batch; adapters that cannot work are refused at create, naming the line."""

from __future__ import annotations

import threading

import pytest

from exl3cli.client.local import LocalClient
from exl3cli.engine.adapters.lora import AdapterBank
from exl3cli.errors import ModelfileError
from exl3cli.runtime.adapters import adapter_files
from tests.engine.test_lora import make_adapter
from tests.fixtures.tiny_model import tiny_reference_model
from tests.fixtures.tiny_store import TINY_VOCAB


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    reference = tiny_reference_model("llama", vocab_size=TINY_VOCAB)
    return {"a": make_adapter(reference, root / "a", seed=1),
            "b": make_adapter(reference, root / "b", seed=2, rank=8,
                              targets=["q_proj", "v_proj", "down_proj"], rslora=True),
            "wide": make_adapter(tiny_reference_model("llama", hidden_size=96), root / "wide",
                                 seed=3)}


@pytest.fixture(scope="module")
def local(store, loras):
    client = LocalClient(store)
    for name in ("a", "b"):
        list(client.create({"model": f"tiny-{name}",
                            "modelfile": f"FROM tiny\nADAPTER {loras[name]}\n"}))
    yield client
    client._inference().close()


def greedy(client, model: str, prompt: str = "hello there") -> str:
    req = {"model": model, "prompt": prompt, "stream": False, "raw": True,
           "options": {"temperature": 0, "num_predict": 10}}
    return "".join(chunk.get("response", "") for chunk in client.generate(req))


def test_create_stores_the_adapter_and_show_lists_it(local, loras, store):
    manifest = store.read_manifest("tiny-a")
    assert sorted(adapter_files(manifest)) == ["adapter_config.json",
                                               "adapter_model.safetensors"]
    assert manifest.adapter == str(loras["a"])
    info = local.show({"model": "tiny-a"})
    assert info["adapter"] == str(loras["a"])
    assert f"ADAPTER {loras['a']}" in info["modelfile"]
    # show --modelfile reads back unchanged, even once the folder is gone elsewhere.
    list(local.create({"model": "tiny-a2", "modelfile": info["modelfile"]}))
    assert store.read_manifest("tiny-a2").files == manifest.files
    # A stored model's name reuses its adapter; a model without one is refused.
    list(local.create({"model": "tiny-a3", "modelfile": "FROM tiny\nADAPTER tiny-a\n"}))
    assert adapter_files(store.read_manifest("tiny-a3")) == adapter_files(manifest)
    with pytest.raises(ModelfileError, match="line 2: ADAPTER tiny: the stored model "
                                             "tiny:latest has no adapter"):
        list(local.create({"model": "x", "modelfile": "FROM tiny\nADAPTER tiny\n"}))


def test_adapted_models_share_one_base_and_batch_together(local, store):
    solo = {name: greedy(local, name) for name in ("tiny-a", "tiny", "tiny-b")}
    assert len(set(solo.values())) == 3  # each adapter changes the text
    runner = local._inference()
    assert len(runner._loaded) == 1  # one base model for the three names
    model = next(iter(runner._loaded.values())).text_model.model
    assert len(AdapterBank.of(model).names) == 2
    results: dict[str, str] = {}
    steps: list[list[int]] = []
    generator = runner.generator_for("tiny")
    generator.step_observers.append(lambda report: steps.append(report.job_ids))
    # The generator steps only once all three jobs are in: a job of 10 tokens can
    # finish before a thread that starts late on a busy machine submits its own.
    all_in, submitted = threading.Event(), []
    submit, step = generator.submit, generator.step

    def submit_counted(job):
        handle = submit(job)
        submitted.append(handle)
        if len(submitted) == len(solo):
            all_in.set()
        return handle

    def step_when_all_in():
        all_in.wait(timeout=60)
        return step()

    generator.submit, generator.step = submit_counted, step_when_all_in
    threads = [threading.Thread(target=lambda n=name: results.update({n: greedy(local, n)}))
               for name in solo]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    generator.step_observers.clear()
    del generator.submit, generator.step
    assert all_in.is_set()
    assert results == solo
    assert max(len(ids) for ids in steps) >= 2  # rows of different adapters shared a step


@pytest.mark.parametrize("line,message", [
    ("ADAPTER {wide}", r"line 2: adapter .*wide: shape mismatch at model\.layers\.0\."),
    ("ADAPTER ./no-such-lora", "line 2: ADAPTER ./no-such-lora: no such folder"),
    ("ADAPTER {tmp}/lora.gguf", r"line 2: adapter .*lora.gguf: .*GGUF file"),
    ("ADAPTER {tmp}", "line 2: ADAPTER .*: not a PEFT LoRA folder"),
    ("ADAPTER no-such-model", "line 2: ADAPTER no-such-model: no such folder or stored model"),
])
def test_bad_adapters_are_refused_at_create(local, loras, store, tmp_path, line, message):
    (tmp_path / "lora.gguf").write_bytes(b"GGUF")
    text = "FROM tiny\n" + line.format(wide=loras["wide"], tmp=tmp_path) + "\n"
    with pytest.raises(ModelfileError, match=message):
        list(local.create({"model": "refused", "modelfile": text, "base_dir": str(tmp_path)}))
    assert not store.exists("refused")


def test_a_gguf_lora_file_as_adapter(local, loras, store, tmp_path):
    from tests.gguf.test_lora import write_gguf_lora

    write_gguf_lora(loras["a"], tmp_path / "a.gguf", alpha=8.0)
    list(local.create({"model": "tiny-gguf", "modelfile": "FROM tiny\nADAPTER ./a.gguf\n",
                       "base_dir": str(tmp_path)}))
    assert sorted(adapter_files(store.read_manifest("tiny-gguf"))) == [
        "adapter_config.json", "adapter_model.safetensors"]
    assert greedy(local, "tiny-gguf") == greedy(local, "tiny-a")


def test_idle_adapters_are_unloaded_past_the_resident_limit(local, store, monkeypatch,
                                                             tmp_path):
    import exl3cli.runtime.adapters as adapters

    first = {name: greedy(local, name) for name in ("tiny-a", "tiny-b")}
    monkeypatch.setattr(adapters, "MAX_RESIDENT_ADAPTERS", 2)
    reference = tiny_reference_model("llama", vocab_size=TINY_VOCAB)
    folder = make_adapter(reference, tmp_path / "c", seed=9, targets=["o_proj"])
    list(local.create({"model": "tiny-c", "modelfile": f"FROM tiny\nADAPTER {folder}\n"}))
    greedy(local, "tiny-c")
    bank = AdapterBank.of(next(iter(local._inference()._loaded.values())).text_model.model)
    assert len(bank.names) == 2
    assert {name: greedy(local, name) for name in first} == first  # loaded again as needed
    assert len(bank.names) == 2
