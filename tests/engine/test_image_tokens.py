"""ImageTokens.embed: image ids read their held rows in prompt order, whatever the runs
look like (two images whose ids follow on, the same image twice, a chunk that starts
inside an image), text ids the table."""

from __future__ import annotations

import torch

from exl3cli.engine.models.vision.image_tokens import ImageTokens


def test_embed_reads_each_image_id_its_row():
    tokens = ImageTokens(vocab_size=10)
    a = torch.arange(12.0).reshape(3, 4)  # image A: ids 10, 11, 12
    b = 100 + torch.arange(8.0).reshape(2, 4)  # image B: ids 13, 14 (follow A's on)
    assert tokens.ids_for("a", lambda: a) == [10, 11, 12]
    assert tokens.ids_for("b", lambda: b) == [13, 14]
    table = torch.arange(40.0).reshape(10, 4) * -1
    ids = [1, 10, 11, 12, 13, 14, 2, 10, 11, 12, 12, 11, 14]
    got = tokens.embed(torch.tensor([ids]), lambda x: table[x])[0]
    rows = {10: a[0], 11: a[1], 12: a[2], 13: b[0], 14: b[1]}
    want = torch.stack([rows[i] if i >= 10 else table[i] for i in ids])
    assert torch.equal(got, want)
    inside = tokens.embed(torch.tensor([[11, 12, 13, 3]]), lambda x: table[x])[0]
    assert torch.equal(inside, torch.stack([a[1], a[2], b[0], table[3]]))
