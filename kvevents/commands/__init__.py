"""Sub-commands of the ``kvevents`` CLI, one module each (see ``kvevents.cli``)."""
