"""The inference engine, in floors (imports run down): generation/ (the batched generator,
decode steps, sampling, speculative decoding, TextModel) > adapters/ (LoRA) > models/
(CausalLM, loader, placement, weights, vision) > layers/ (attention, MLP, MoE, linears,
norms, rotary, the fused decode layer) > kvcache/ (paged cache and its attention) >
spec/ (config.json, architectures), text/ (tokenizer, chat templates), grammar/
(structured output).

Names (some collide with names on other floors; from the model outward):
- `CausalLM` (models/causal_lm.py): the network, an nn.Module: token ids (and an
  `AttentionCache`, kvcache/attention_cache.py) in, logits out. No tokenizer.
- `VisionModel` (models/vision/loader.py): an image-text model's image side (vision
  tower, projector, image processor, image token ids).
- `TextModel` (generation/textmodel.py): a CausalLM with its Tokenizer, ChatTemplate and
  folder (and VisionModel): what a model folder loads as.
- `GenerationJob` (generation/jobs.py): one request to the Generator (prompt ids,
  sampler, stops, limits); `Generator.submit` answers a `JobHandle` (its events,
  cancellation); `ActiveJob` is the generator's own record of an admitted job (pages,
  position, text state).
- `DecodeRunner` (generation/decode_step.py): the fixed-shape decode steps (CUDA graphs)
  of one model over one page pool: the device step the generator replays.
Outside the engine: `LLM` (exl3cli/api.py) is the Python API's handle on a TextModel
and its Generator; `LoadedModel` (runtime/loaded_model.py) is a TextModel resident in the
runner with its keep-alive bookkeeping; `InferenceRunner` (runtime) serves requests;
`GenerateJob`/`ChatJob` (runtime/jobs.py) turn an Ollama request into a GenerationJob;
`StreamJob` (server/model_manager.py) relays one request's stream to the event loop;
`LayerRunner` (convert/layer_forward.py) runs one layer's forward for quantization.
"""
