"""The task families, one a module: ``addition`` (digit by digit), ``sorting`` (bubble-sort
passes), ``search`` (countdown search with failed attempts). ``tailrl.tasks.mixture`` mixes
them into the workload."""
