"""DVC stage `source`: fingerprint the data that `data.source` names, so DVC sees an edit to it.

DVC hashes params by value, so a local file or folder named by `data.source` was invisible to it: an edited row
was trained on in its old form. This stage runs on every `dvc repro` and `dvc exp run` (`always_changed`) and
writes what the source holds (each file's MD5 and size, or a hub dataset's id and pinned `data.revision`), and the
files of a local `model.name_or_path` folder, into metrics/data_source.json; tokenize and train depend on that file,
so they re-run exactly when the data or the local model changed
(`pipelines.data.fingerprint`). A local-looking path that does not exist is refused here, naming what is there.
"""

from __future__ import annotations

from pathlib import Path

from pipelines.atomic import atomic_write_json
from pipelines.errors import run_cli
from pipelines.params import load_params

FINGERPRINT = Path("metrics/data_source.json")


def main() -> None:
    from pipelines.data.fingerprint import file_hashes, fingerprint, local_model_folder, resolve_source

    params = load_params()
    root = Path.cwd()
    source = resolve_source(params.data.source, root)
    found = fingerprint(source, params.data.revision, root)
    # A local model folder too: its files are as invisible to DVC as the data's (a hub model: model.revision).
    if (model := local_model_folder(params.model.name_or_path, root)) is not None:
        found["model"] = {"name_or_path": params.model.name_or_path, "files": file_hashes(model, root)}
    atomic_write_json(FINGERPRINT, found)  # DVC compares its hash: the same data, the same file, no re-run


if __name__ == "__main__":
    run_cli(main)
