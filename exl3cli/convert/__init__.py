"""EXL3 quantizer: calibration, Hessians, LDLQ + trellis Viterbi, bit allocation,
sequential resumable conversion (EXL3-FORMAT.md section 5).

Every family is calibrated through the engine's own decoder layers (engine_layer.py:
built by the engine's ``build_decoder_layer``, engine/models/decoder_layer.py), so a
model is quantized on the activations it computes, and the sensitivity pass of the bit
allocation runs them too.

Entry point: ``pipeline.convert_model(src, out_dir, ConvertOptions(bits=...), work_dir,
resume=False, progress=None) -> report.ConversionSummary``. Modules: calibration,
engine_layer (the calibration forward), hessian, ldlq, quantize_layer, moe_layer
(per-expert Hessians), sensitivity, knapsack, allocation, allocation_plan, recipe,
pipeline, work_folder (checkpoints, resume), report, source, fused_source, synthetic,
quality (perplexity / KL for benchmarks).
"""
