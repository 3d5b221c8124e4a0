"""What answers a request, under the daemon and the in-process client: the model library
(list, show, copy, delete, create, pull), residency (which models are loaded, keep-alive,
the scheduler of requests onto generators), request jobs and options, tool calls,
embeddings, log-probabilities and images of requests.

Names (several collide with the engine's; see exl3cli/engine/__init__.py):
- `InferenceRunner` (residency.py): loads models from the store and serves generate,
  chat, embed and ps in-process, with Ollama-shaped dicts in and out; the daemon
  (server/model_manager.py) and the in-process client (client/local.py) both call it.
  Not the engine's `DecodeRunner` (fixed-shape decode steps) nor convert's `LayerRunner`.
- `LoadedModel` (loaded_model.py): one resident model: its engine `TextModel` (a CausalLM
  with tokenizer and chat template), its Generator, size and keep-alive deadline, as
  /api/ps reports it. `InferenceRunner.holding(...)` keeps one loaded for a block.
- `GenerateJob`, `ChatJob` (jobs.py): one /api/generate or /api/chat request: its
  prompt ids and the shape of its response objects. Each submits one engine
  `GenerationJob` (generation/jobs.py) to the model's Generator; the server's
  `StreamJob` carries the responses of either to an HTTP stream.
- `ModelLibrary` (library.py): the store operations (list, show, copy, delete, create,
  pull); no model is loaded by it.
"""
