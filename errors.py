"""errors.py: the named errors that several modules raise, in one module that imports nothing of the project (so that
a module raising one need not import the config loader or the taskset reader for it).

A process stops on one of them with its one-line message and exit code 2, never a traceback (launch.run_in_process;
configs.entry for the config's own):
- ConfigError: a config problem, naming the key's path (configs/, workflows/args.py, lora.py, models.py;
  checkpoint.py: a resume with another model.model_path or algorithm_type than the checkpoint was trained with);
- DataError: a problem of a data file, a taskset row, a pointer file or a weights folder, naming the file, the row
  and the key (tasksets.py, source.py, sync.py, checkpoint.py, lora.py).
"""


class ConfigError(ValueError):
    """A config problem, with the path of the offending key in the message."""


class DataError(ValueError):
    """A taskset or data file problem, naming the file, row and key."""
