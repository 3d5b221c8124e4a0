"""The Python API: load a model once, generate text, serve many requests at once.

    from exl3cli.api import load

    llm = load(model_path, max_seq_len=1024, kv_cache_type="q8")
    print(llm.generate("The sky is", max_tokens=16, temperature=0))
    for chunk in llm.generate("Once upon a time", max_tokens=16, stream=True):
        print(chunk, end="", flush=True)
    reply = llm.chat([{"role": "user", "content": "Hello!"}], max_tokens=16)
    jobs = [llm.submit(p, max_tokens=8) for p in ["One", "Two", "Three"]]
    answers = [job.text() for job in jobs]  # the three ran as one batch

Image-text models (Gemma 3, Qwen2.5-VL) take images as file paths or bytes, in a prompt or
in chat messages (a text-only model refuses them with InvalidOption):

    llm.generate("What is in this picture?", images=["cat.png"], max_tokens=32)
    llm.chat([{"role": "user", "content": "Describe it.", "images": [png_bytes]}])

`model` is a model folder (Hugging Face layout) or a name in the local model store
(`exl3 pull` puts models there). Every call goes through one `Generator`
(exl3cli/engine/generation/generator.py): a paged, optionally quantized KV cache with continuous
batching and prefix reuse, so concurrent callers (threads) share the model.
LoRA adapters: `llm.load_adapter(folder, name)` (or `load(..., adapters={name: folder})`),
then `adapter=name` per request; requests with different adapters share one batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.generator_thread import GeneratorThread
from exl3cli.engine.generation.jobs import GenerationJob, JobHandle
from exl3cli.engine.generation.speculative import DEFAULT_DRAFT_TOKENS, make_drafter, resolve_draft
from exl3cli.engine.generation.textmodel import TextModel

__all__ = ["LLM", "load"]

Prompt = str | list[int]
Messages = list[dict[str, Any]]


class LLM:
    """A loaded model with its tokenizer, chat template and generator."""

    def __init__(self, text_model: TextModel, generator: Generator,
                 draft: str | None = None, draft_tokens: int = DEFAULT_DRAFT_TOKENS):
        self.text_model = text_model
        self.generator = generator
        self.draft = draft  # a drafter name or a draft model folder (speculative decoding)
        self.draft_tokens = draft_tokens
        self._thread: GeneratorThread | None = None

    @property
    def tokenizer(self) -> Any:
        return self.text_model.tokenizer

    @property
    def model(self) -> Any:
        return self.text_model.model

    def submit(
        self,
        prompt: Prompt | Messages,
        *,
        max_tokens: int = -1,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: list[str] | None = None,
        truncate: bool = False,
        images: list[Any] | None = None,
        adapter: str | None = None,
        **options: Any,
    ) -> JobHandle:
        """Start one request and return its handle (iterate it for events, or
        `.text()`); a text prompt is encoded as is (`images`, file paths or bytes, go ahead
        of it), a message list (each message may carry "images") through the chat
        template. `options` are further sampler options (min_p, repeat_penalty...).
        `adapter` names a LoRA adapter loaded with `load_adapter` (None: the base)."""
        sampler_options = {name: value for name, value in
                           {"temperature": temperature, "top_p": top_p, "top_k": top_k,
                            "seed": seed, **options}.items() if value is not None}
        job = GenerationJob(
            prompt_ids=self._prompt_ids(prompt, images), options=sampler_options,
            stop=list(stop or ()), num_predict=max_tokens, truncate=truncate,
            # One drafter per job: a draft model keeps a cache of this job's text.
            drafter=make_drafter(self.draft) if self.draft else None,
            draft_tokens=self.draft_tokens if self.draft else 0,
            adapter=adapter,
        )
        return self.generator.submit(job)

    def load_adapter(self, path: str | Path, name: str | None = None,
                     scaling: float = 1.0) -> str:
        """Load a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors), or
        a GGUF LoRA file (llama.cpp's layout), on the model under `name` (default: the folder's name), its scale times `scaling`;
        requests choose it with `adapter=name`, each its own, in one batch. AdapterError
        when it does not fit the model. Returns the name."""
        from exl3cli.engine.adapters.lora import load_adapter
        from exl3cli.engine.adapters.peft import read_peft_adapter

        if Path(path).suffix.lower() == ".gguf":  # llama.cpp's layout: made a PEFT folder
            import tempfile

            from exl3cli.gguf.lora import gguf_lora_to_peft

            config = self.model.config
            with tempfile.TemporaryDirectory() as work:
                folder = gguf_lora_to_peft(path, Path(work), name or Path(path).stem,
                                           config.num_heads, config.num_kv_heads)
                adapter = read_peft_adapter(folder, name or Path(path).stem, scaling)
        else:
            adapter = read_peft_adapter(path, name, scaling)
        load_adapter(self.model, adapter, self.generator)
        return adapter.name

    def unload_adapter(self, name: str) -> bool:
        """Remove adapter `name` (InvalidOption while a request uses it)."""
        from exl3cli.engine.adapters.lora import unload_adapter

        return unload_adapter(self.model, name, self.generator)

    @property
    def adapters(self) -> list[str]:
        """The names of the loaded LoRA adapters."""
        bank = getattr(self.model, "adapters", None)
        return [] if bank is None else bank.names

    def generate(self, prompt: Prompt, *, stream: bool = False,
                 **settings: Any) -> str | Iterator[str]:
        """The completion of `prompt` as one string, or (stream=True) text chunks.
        Settings as in `submit`."""
        handle = self.submit(prompt, **settings)
        return _chunks(handle) if stream else handle.text()

    def chat(self, messages: Messages, *, stream: bool = False,
             **settings: Any) -> str | Iterator[str]:
        """The assistant's reply to a conversation ([{"role", "content"}, ...])."""
        if not isinstance(messages, list):
            raise TypeError("chat() takes a list of {'role': ..., 'content': ...} messages")
        return self.generate(messages, stream=stream, **settings)  # type: ignore[arg-type]

    def start_background(self) -> LLM:
        """Step the generator on its own thread (for servers with many callers)."""
        if self._thread is None:
            self._thread = GeneratorThread(self.generator).start()
        return self

    def close(self) -> None:
        """Stop the background thread (and the other ranks of a tensor-parallel model)."""
        if self._thread is not None:
            self._thread.stop()
            self._thread = None
        close = getattr(self.text_model.model, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _prompt_ids(self, prompt: Prompt | Messages, images: list[Any] | None = None) -> list[int]:
        if isinstance(prompt, str):
            return self.text_model.text_prompt(prompt, images)
        if images:
            raise TypeError("images= goes with a text prompt; in a conversation give each "
                            "message its own 'images'")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return self.text_model.chat_prompt(prompt)
        return [int(t) for t in prompt]


def _chunks(handle: JobHandle) -> Iterator[str]:
    for event in handle:
        if event.text:
            yield event.text


def resolve_model_folder(model: str | Path, store_root: str | Path | None = None) -> Path:
    """A folder path as is; anything else is looked up as a model-store name."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    from exl3cli.store.store import ModelStore

    return Path(ModelStore(store_root).model_folder(str(model)))


def load(
    model: str | Path,
    *,
    max_seq_len: int = 4096,
    kv_cache_type: str | None = None,
    max_batch: int = 16,
    num_pages: int | None = None,
    device: Any = None,
    dtype: Any = None,
    store_root: str | Path | None = None,
    background: bool = False,
    draft: str | None = None,
    draft_tokens: int = DEFAULT_DRAFT_TOKENS,
    adapters: dict[str, str | Path] | None = None,
    tensor_parallel: int | None = None,
    gpu_split: Any = None,
) -> LLM:
    """Load a model folder or store name into an LLM.

    `max_seq_len` is the longest context of one request; `kv_cache_type` is fp16
    (default, or $EXL3_KV_CACHE_TYPE), q8, q6, q4, kXvY; `max_batch` requests run
    together; `num_pages` (256 tokens each) sizes the cache, by default for
    max_batch full contexts. `background=True` runs the generator on a thread.
    `draft` turns on speculative decoding: "ngram" (prompt lookup) or a small draft
    model (folder or store name) with the same vocabulary, proposing up to
    `draft_tokens` tokens per step; greedy output is unchanged by it.
    `adapters` ({name: PEFT LoRA folder}) are loaded for requests to choose
    (`adapter=name`); `LLM.load_adapter` adds more later.
    `tensor_parallel=N` splits the model over N GPUs (one process each; on the CPU,
    N gloo processes: for tests); `gpu_split` ("auto" or GiB per GPU, [20, 24])
    places whole layers on the GPUs in turn. `LLM.close()` stops the other ranks.
    """
    text_model = TextModel.load(resolve_model_folder(model, store_root), device=device,
                                dtype=dtype, tensor_parallel=tensor_parallel,
                                gpu_split=gpu_split)
    generator = Generator(
        text_model.model, text_model.tokenizer, max_batch=max_batch, num_ctx=max_seq_len,
        kv_cache_type=kv_cache_type, num_pages=num_pages,
    )
    if draft:
        draft = resolve_draft(draft, lambda name: resolve_model_folder(name, store_root))
        make_drafter(draft)  # a bad name or a missing model fails here, not per request
    llm = LLM(text_model, generator, draft, draft_tokens)
    for name, path in (adapters or {}).items():
        llm.load_adapter(path, name)
    return llm.start_background() if background else llm
