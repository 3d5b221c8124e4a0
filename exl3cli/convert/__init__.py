"""EXL3 quantizer: calibration, Hessians, LDLQ + trellis Viterbi, bit allocation,
sequential resumable conversion (EXL3-FORMAT.md section 5).

Entry point: ``pipeline.convert_model(src, out_dir, ConvertOptions(bits=...), work_dir,
resume=False, progress=None) -> report.ConversionSummary``. Modules: calibration,
hessian, ldlq, quantize_layer, layer_forward (engine_layer for Gemma), allocation,
pipeline, report, source, quality (perplexity / KL for benchmarks).
"""
