"""`exl3 convert SRC -b BPW`: quantize a model to EXL3 (folder and/or store entry)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import click


def _default_work_dir(store_root: Path, src: str, bits: float | str | None) -> Path:
    key = hashlib.sha256(f"{Path(src).expanduser().resolve()}|{bits}".encode()).hexdigest()[:12]
    return store_root / "convert-work" / key


@click.command("convert")
@click.argument("src")
@click.option("-b", "--bits", "bits", type=click.FloatRange(1.5, 8.0), default=None,
              help="Target average bits per weight of the decoder layers (1.5..8); "
                   "needed unless --recipe sets every tensor.")
@click.option("-o", "name", default=None, help="Register the result in the store as NAME:TAG.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Write the EXL3 folder here.")
@click.option("--head-bits", type=click.IntRange(1, 16), default=6, show_default=True,
              help="Bits of the output head (16 keeps it unquantized).")
@click.option("--embed-bits", type=click.IntRange(1, 16), default=16, show_default=True,
              help="Bits of the token embedding table: 1..8 stores it trellis-quantized "
                   "as ExLlamaV3 does (.trellis + .signs), 16 keeps it as it is.")
@click.option("--recipe", "recipe_file", type=click.Path(dir_okay=False, exists=True),
              default=None,
              help="YAML/JSON file of tensor-name patterns -> bits (1..8, 16 = keep "
                   "unquantized); later entries override earlier ones; tensors it leaves "
                   "out share the -b budget. Every conversion writes its own bits as "
                   "exl3-recipe.json in the output folder, to edit and feed back.")
@click.option("--allocation", type=click.Choice(["measured", "fixed"]), default="measured",
              show_default=True,
              help="How bits are spread over tensors: measured sensitivity + knapsack, or "
                   "the fixed order (attention first, then the MLP, ends of the stack first).")
@click.option("--allocation-unit", type=click.Choice(["tensor", "group"]), default="tensor",
              show_default=True,
              help="Measured bits per tensor, or per group of tensors sharing an input "
                   "(q/k/v, gate/up: one LDLQ pass each, faster).")
@click.option("--out-scales", type=click.Choice(["fisher", "rms"]), default="fisher",
              show_default=True,
              help="Output-channel scales of each tensor: from the Fisher information of its "
                   "outputs (measured on the calibration rows), or the plain column RMS.")
@click.option("--codebook", type=click.Choice(["mul1", "mcg", "3inst"]), default="mul1",
              show_default=True)
@click.option("--work", "work_dir", type=click.Path(file_okay=False), default=None,
              help="Work folder for checkpoints (default: under the store).")
@click.option("--resume", is_flag=True, help="Continue an interrupted conversion.")
@click.option("--force", is_flag=True,
              help="Start over even if the work folder holds finished layers (deletes them).")
@click.option("--calib", "calib", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Calibration text file (default: the bundled sample).")
@click.option("--calib-rows", type=click.IntRange(1), default=None, help="Calibration rows.")
@click.option("--calib-cols", type=click.IntRange(16), default=None,
              help="Tokens per calibration row.")
@click.option("--scale-search-tiles", type=click.IntRange(0), default=16, hidden=True)
@click.option("--device", default=None, help="torch device (default: cuda if present).")
def convert(src: str, bits: float, name: str | None, out_dir: str | None, head_bits: int,
            codebook: str, work_dir: str | None, resume: bool, force: bool, calib: str | None,
            calib_rows: int | None, calib_cols: int | None, scale_search_tiles: int,
            device: str | None, recipe_file: str | None = None,
            allocation: str = "measured", allocation_unit: str = "tensor",
            out_scales: str = "fisher", embed_bits: int = 16) -> None:
    """Quantize SRC (HF folder, GGUF file, store or hub name) to EXL3."""
    from exl3cli.cli.progress import ProgressPrinter
    from exl3cli.convert.calibration import DEFAULT_COLS, DEFAULT_ROWS
    from exl3cli.convert.pipeline import ConvertOptions, convert_model
    from exl3cli.convert.report import LayerReport
    from exl3cli.convert.source import resolve_source
    from exl3cli.store.names import ModelName
    from exl3cli.store.store import ModelStore

    if name is None and out_dir is None:
        raise click.UsageError("give -o NAME:TAG, --out DIR, or both")
    if 8 < embed_bits < 16:
        raise click.BadParameter("1..8 (trellis bits) or 16 (kept as it is)",
                                 param_hint="--embed-bits")
    if bits is None and recipe_file is None:
        raise click.UsageError("give -b BPW (or a --recipe that sets every tensor)")
    recipe = ()
    if recipe_file is not None:
        from exl3cli.convert.recipe import load_recipe

        recipe = load_recipe(recipe_file)
    if name is not None:
        ModelName.parse(name)  # reject a bad name before hours of work
    store = ModelStore()
    work = Path(work_dir) if work_dir else _default_work_dir(
        store.root, src, bits if not recipe else f"{bits}|{recipe}")
    pulling = ProgressPrinter()  # a pull of SRC shows what `exl3 pull` shows
    try:
        source = resolve_source(src, store, work.with_name(work.name + "-src"), pulling)
    finally:
        pulling.close()
    options = ConvertOptions(
        bits=bits, head_bits=head_bits, codebook=codebook,
        rows=calib_rows or DEFAULT_ROWS, cols=calib_cols or DEFAULT_COLS,
        calib_path=str(Path(calib).resolve()) if calib else None,
        scale_search_tiles=scale_search_tiles, device=device, recipe=recipe,
        allocation=allocation, allocation_unit=allocation_unit, out_scales=out_scales,
        embed_bits=embed_bits,
    )
    target = Path(out_dir) if out_dir else work.with_name(work.name + "-out")

    from exl3cli.convert.report import LayerClock
    from exl3cli.engine.spec.architecture import load_family_config

    num_layers = load_family_config(source).num_layers
    clock = LayerClock(num_layers)

    def progress(event: LayerReport | str) -> None:
        if isinstance(event, LayerReport):
            click.echo(event.line_with_eta(num_layers, clock.remaining(event)), err=True)
        else:
            click.echo(event, err=True)

    summary = convert_model(source, target, options, work, resume=resume, progress=progress,
                            force=force)
    click.echo(summary.table())
    if name is not None:
        store.import_folder(name, target, {"type": "convert", "from": src,
                                           "bits": bits if bits is not None
                                           else round(summary.average_bits, 3),
                                           "head_bits": summary.head_bits,
                                           "codebook": codebook})
        click.echo(f"registered {name}")
    if out_dir is None:
        shutil.rmtree(target, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(work.with_name(work.name + "-src"), ignore_errors=True)
    click.echo(f"wrote {target}" if out_dir else "done")


COMMANDS = [convert]
