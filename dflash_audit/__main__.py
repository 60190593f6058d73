from dflash_audit.cli import entry_point

entry_point()
