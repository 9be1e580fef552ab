"""Synchronisation across virtual workers, runtime side: WSP waves and AllReduce."""
