"""picotron_like: the parts of the lessons that are not a parallelism technique.

model     the reference GPT every lesson is proven equal to
data      token shards through np.memmap, the built-in corpus, per-rank batches
topology  start-up, the 5D process grid and its validation, loading lessons by file name
comm      the communication meter lessons call collectives through
train     optimizer, schedule, clipping, logging, throughput and memory reports
testing   spawning real gloo ranks in tests
"""
