"""A loaded model with its tokenizer and chat template: messages in, text out.

`stream` runs through the batched generator (generator.py) like every other request:
one engine, one token loop."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.generation.sampling import ParamSpec, build_sampler
from exl3cli.engine.generation.text_events import TextEvent
from exl3cli.engine.grammar.constraints import build_constraint
from exl3cli.engine.text.chat_template import ChatTemplate
from exl3cli.engine.text.tokenizer import Tokenizer
from exl3cli.errors import InvalidOption

# Ollama's default context when a request does not set num_ctx.
DEFAULT_NUM_CTX = 4096


class TextModel:
    """CausalLM + Tokenizer + ChatTemplate for one model folder."""

    def __init__(
        self,
        model: Any,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate,
        folder: Path | None = None,
        vision: Any = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.folder = folder
        # engine/models/vision/loader.VisionModel of an image-text model; None: text only.
        self.vision = vision
        self._generator: Generator | None = None
        self._lock = threading.Lock()

    @classmethod
    def load(
        cls,
        folder: str | Path,
        device: Any = None,
        dtype: Any = None,
        template: str | None = None,
        gpu_layers: int | None = None,
        tensor_parallel: int | None = None,
        gpu_split: Any = None,
    ) -> TextModel:
        """Load weights, tokenizer and template from an HF-style folder.

        `template` (a Modelfile TEMPLATE) replaces the folder's chat template;
        `gpu_layers` (num_gpu) is passed to the loader's memory plan.
        `tensor_parallel` N > 1 splits the model over N devices, one process each
        (tp_launch.py); `gpu_split` ("auto" or GiB per device, e.g. "20,24") places
        whole layers on the CUDA devices in turn instead (models/layer_split.py).
        """
        from exl3cli.engine.models.loader import load_causal_lm
        from exl3cli.engine.models.vision.loader import load_vision

        folder = Path(folder)
        tokenizer = Tokenizer.from_folder(folder)
        chat_template = ChatTemplate.from_folder(folder, template=template)
        if tensor_parallel is not None and int(tensor_parallel) > 1:
            if gpu_split is not None:
                raise InvalidOption("tensor_parallel and gpu_split are two ways to use "
                                    "several devices: choose one")
            from exl3cli.engine.generation.tp_launch import load_tensor_parallel

            model = load_tensor_parallel(folder, int(tensor_parallel), device=device, dtype=dtype)
            return cls(model, tokenizer, chat_template, folder)
        if gpu_split is not None:
            from exl3cli.engine.models.layer_split import load_layer_split

            model = load_layer_split(folder, split=gpu_split, dtype=dtype)
        else:
            model = load_causal_lm(folder, device=device, dtype=dtype, gpu_layers=gpu_layers)
        return cls(model, tokenizer, chat_template, folder,
                   vision=load_vision(folder, model, tokenizer))

    @property
    def max_context(self) -> int:
        """The longest context the model was trained for."""
        config = getattr(self.model, "config", None)
        return int(getattr(config, "max_position_embeddings", DEFAULT_NUM_CTX))

    def context_length(self, options: dict[str, Any] | None = None) -> int:
        """num_ctx from the options (default 4096), never beyond the model's own limit."""
        requested = ParamSpec(int, DEFAULT_NUM_CTX, minimum=1).coerce(
            "num_ctx", (options or {}).get("num_ctx")
        )
        return min(requested, self.max_context)

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of the rendered conversation, BOS added only if the template
        did not already write it and the model wants one."""
        images: list[bytes] = []
        if any(message.get("images") for message in messages):
            messages, images = self._placed_images(messages)
        text = self.chat_template.render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools
        )
        if images:
            return self.vision.prompt_ids(text, images, self.tokenizer.encode)
        return self.tokenizer.encode(text)

    def _placed_images(self, messages: list[dict[str, Any]]
                       ) -> tuple[list[dict[str, Any]], list[bytes]]:
        """Messages with image placeholders, and the images (bytes or file paths)."""
        from exl3cli.engine.models.vision.loader import place_images, read_image

        if self.vision is None:
            raise InvalidOption("this model does not support images (it reads text only)")
        return place_images(messages, self.vision.placeholder, read_image)

    def text_prompt(self, prompt: str, images: list[Any] | None = None) -> list[int]:
        """Token ids of a plain text prompt; `images` (bytes or file paths) go ahead of
        the text, or where the text already writes the model's image placeholders."""
        if not images:
            return self.tokenizer.encode(prompt)
        messages, data = self._placed_images([{"role": "user", "content": "", "images": images}])
        marked = prompt if prompt.count(self.vision.placeholder) == len(data) else \
            messages[0]["content"] + prompt
        return self.vision.prompt_ids(marked, data, self.tokenizer.encode)

    def generator(self, num_ctx: int) -> Generator:
        """This model's generator for `stream`, made on first use and made again for a
        longer context while it is idle."""
        with self._lock:
            current = self._generator
            if current is None or (current.num_ctx < num_ctx and not current.has_work):
                current = self._generator = Generator(self.model, self.tokenizer,
                                                      max_batch=1, num_ctx=num_ctx)
            return current

    def stream(
        self,
        prompt_ids: list[int],
        options: dict[str, Any] | None = None,
        stop: Iterable[str] = (),
        num_predict: int = -1,
        cancel: threading.Event | None = None,
        format: Any = None,
    ) -> Iterator[TextEvent]:
        """Text deltas for `prompt_ids`, then a done event, from one job of this model's
        generator (generator_jobs.GeneratorEvent, a TextEvent).

        `format` ("json" or a JSON schema) constrains the answer (engine/grammar/constraints.py).
        Raises InvalidOption for bad sampler options or formats before anything is
        generated; ContextOverflow when the prompt does not fit (on first iteration).
        The sampler's `unknown_options` are not reported here (build one with
        build_sampler first to warn about them).
        """
        sampler = build_sampler(options)
        constraint = build_constraint(format, self.tokenizer)
        num_ctx = self.context_length(options)
        job = GenerationJob(list(prompt_ids), sampler=sampler, stop=list(stop),
                            num_predict=num_predict, num_ctx=num_ctx, constraint=constraint)

        def events() -> Iterator[TextEvent]:
            handle = self.generator(num_ctx).submit(job)
            yield from handle.iter_events(cancel=cancel)
            final = handle.final
            if final is not None and final.cancelled:
                yield final  # a cancelled job still ends with its done event

        return events()
