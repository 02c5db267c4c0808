"""The agreed transfer timeouts: one source, and the orders DESIGN invariant 2 relies on."""

import pytest

from glmserve.kv.transfer.timeouts import AGREED, TransferTimeouts
from glmserve.services.decode.main import DecodeConfig
from glmserve.services.decode.worker import DecodeSettings
from glmserve.services.host_tier_link import HostTierSettings
from glmserve.services.kvstore.host_tier import HostTier
from glmserve.services.kvstore.main import KVStoreConfig
from glmserve.services.worker_server import DEFAULT_TRANSFER_TIMEOUT_S


def test_a_writer_is_done_well_before_a_receiver_reuses_its_blocks():
    assert AGREED.write_s + AGREED.drain_s < AGREED.release_s < AGREED.lease_s


def test_every_service_reads_the_agreed_values():
    assert DEFAULT_TRANSFER_TIMEOUT_S == AGREED.write_s  # prefill workers (and the kvstore) write
    assert DecodeSettings().prefill_timeout_s == DecodeConfig.prefill_timeout_s == AGREED.release_s
    assert HostTierSettings.load_timeout_s == AGREED.release_s
    assert KVStoreConfig.host_lease_timeout_s == AGREED.lease_s
    assert HostTier.__init__.__kwdefaults__["lease_timeout_s"] == AGREED.lease_s


def test_invalid_values_name_the_field():
    with pytest.raises(ValueError, match="^drain_s:"):
        TransferTimeouts(drain_s=0)
