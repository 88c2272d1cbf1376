"""`corral bench prefix`: what the prefix cache saves at admission (TTFT), with the cache on and off."""
