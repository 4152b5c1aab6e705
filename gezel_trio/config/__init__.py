"""The host's configuration: :mod:`.schema` (the TOML file's tables, read and checked),
:mod:`.models_dir` (the models a folder holds) and :mod:`.check` (``gezel-trio
check-config``: the file against this machine)."""
