"""Which file holds a language model's text embeddings, recorded on the model as it is read.

The language model of a vision-language export (optimum-intel's `image-text-to-text`:
`openvino_language_model.xml`) takes `inputs_embeds` [B, S, H] where a text model takes
`input_ids`; its text embeddings model beside it (`openvino_text_embeddings_model.xml`: token
ids in, their rows out) gives those rows. `kvc.ir.load` records that file's absolute path in
the model's rt_info (`RT_KEY`), which every clone carries, so that a session opened over any
model derived from it finds it (kvc.runtime.embeddings). The path is this machine's: nothing
kvc writes holds it (the IR is saved, and blobs are compiled, `detach`ed; the text form leaves
it out).
"""

from __future__ import annotations

from pathlib import Path

import openvino as ov

TEXT_EMBEDDINGS = "openvino_text_embeddings_model.xml"  # optimum-intel's name, kept in a compiled directory
TEXT_EMBEDDINGS_FILES = (TEXT_EMBEDDINGS, TEXT_EMBEDDINGS.replace(".xml", ".bin"))  # the model and its weights
TOKEN_EMBEDS = "inputs_embeds"
# Model rt_info naming the text embeddings model found beside it (an absolute path; never saved).
RT_KEY = "kvc_text_embeddings"


def token_input(names) -> str:
    """The token input of a model with inputs of these `names`: `inputs_embeds` when it takes
    that and not `input_ids`, else `input_ids`."""
    return TOKEN_EMBEDS if TOKEN_EMBEDS in names and "input_ids" not in names else "input_ids"


def takes_embeds(model: ov.Model) -> bool:
    """Whether `model`'s token input is `inputs_embeds` (`token_input`)."""
    return token_input({n for p in model.inputs for n in p.get_names()}) == TOKEN_EMBEDS


def attach(model: ov.Model, model_path: Path) -> None:
    """Record on `model` (read from `model_path`) the text embeddings model beside it, when it
    takes `inputs_embeds` and one is there."""
    beside = Path(model_path).parent / TEXT_EMBEDDINGS
    if takes_embeds(model) and beside.is_file():  # not resolved: reading it refuses a link out of the directory
        model.get_rt_info()[RT_KEY] = str(beside.absolute())


def detach(model: ov.Model) -> str | None:
    """Drop the record and return it (a model is saved without it: the path is this machine's)."""
    rt = model.get_rt_info()
    if RT_KEY not in rt:
        return None
    path = rt[RT_KEY].astype(str)
    del rt[RT_KEY]
    return path


def reattach(model: ov.Model, path: str | None) -> None:
    """Put back what `detach` returned."""
    if path is not None:
        model.get_rt_info()[RT_KEY] = path
