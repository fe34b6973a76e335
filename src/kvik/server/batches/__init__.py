"""OpenAI's Batch API: input files, batches that run in the background tier, results that survive a
restart (`store`), the worker (`runner`) and the routes' logic (`service`)."""
