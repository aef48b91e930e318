//! [`ChunkStore::verify`]: the store's invariants over the tensors' states and the
//! chunks' pins, on top of the mover's own; the first broken one is reported rather
//! than repaired. Changes nothing.

use crate::error::ChunkError;
use crate::id::{ChunkId, ListKind, TensorId};
use crate::state::TensorState;
use crate::Result;

use super::{ChunkStore, ListStates, Place};

impl ChunkStore {
    /// Checks the store's invariants: per chunk, its device and host pins equal its
    /// tensors in COMPUTE there, and it is pinned on one tier at most, where its copy is
    /// ready; every tensor in COMPUTE has a place and no other does; the device bytes
    /// pinned; and the mover's own (copies vs transfers in flight, the lists the
    /// policies see, each tier's bytes in use equal to the copies it holds and within
    /// its budget, the swap file's chunks vs the slots that claim them). The first
    /// broken one is [`ChunkError::Invariant`] naming the chunk and what disagrees.
    /// Cheap enough for tests to call after every operation; changes nothing.
    pub fn verify(&self) -> Result<()> {
        self.mover.verify()?;
        let n = self.mover.chunk_count();
        let mut dev_pins = vec![0u32; n];
        let mut host_pins = vec![0u32; n];
        for list in ListKind::ALL {
            let Some(ls) = self.lists[list as usize].as_ref() else {
                continue;
            };
            self.count_places(list, ls, &mut dev_pins, &mut host_pins)?;
        }
        self.verify_pins(&dev_pins, &host_pins)
    }

    /// Counts `list`'s tensors in COMPUTE per chunk and place, checking that exactly
    /// those have a place and that the state table counts the same.
    fn count_places(
        &self,
        list: ListKind,
        ls: &ListStates,
        dev_pins: &mut [u32],
        host_pins: &mut [u32],
    ) -> Result<()> {
        for (local, place) in ls.place.iter().enumerate() {
            let id = TensorId(local as u32);
            let (Some(state), Some(chunk)) = (ls.table.state(id), ls.table.chunk_of(id)) else {
                return Err(ChunkError::Invariant {
                    chunk: None,
                    what: format!("list {list}: tensor {local} has no state or chunk"),
                });
            };
            let pins = match place {
                Some(Place::Device) => &mut *dev_pins,
                Some(Place::Host) => &mut *host_pins,
                None if state != TensorState::Compute => continue,
                None => {
                    return Err(ChunkError::Invariant {
                        chunk: Some(chunk),
                        what: format!("list {list}: tensor {local} in COMPUTE without a place"),
                    })
                }
            };
            if state != TensorState::Compute {
                return Err(ChunkError::Invariant {
                    chunk: Some(chunk),
                    what: format!("list {list}: tensor {local} has a place but is {state}"),
                });
            }
            pins[chunk.dense()] += 1;
        }
        for chunk in self.layout.chunks(list) {
            let d = chunk.dense();
            let computing = ls.table.count(chunk, TensorState::Compute);
            if computing != dev_pins[d] + host_pins[d] {
                return Err(ChunkError::Invariant {
                    chunk: Some(chunk),
                    what: format!(
                        "state table counts {computing} tensors in COMPUTE, their places {}",
                        dev_pins[d] + host_pins[d]
                    ),
                });
            }
        }
        Ok(())
    }

    /// Every chunk's pins equal its tensors in COMPUTE per place (the mover checks the
    /// device bytes pinned against its pins).
    fn verify_pins(&self, dev_pins: &[u32], host_pins: &[u32]) -> Result<()> {
        for d in 0..self.mover.chunk_count() {
            let c = ChunkId::from_dense(d);
            let pins = (
                self.mover.pins(c, Place::Device),
                self.mover.pins(c, Place::Host),
            );
            if pins != (dev_pins[d], host_pins[d]) {
                return Err(ChunkError::Invariant {
                    chunk: Some(c),
                    what: format!(
                        "pins (device {}, host {}) but tensors in COMPUTE (device {}, host {})",
                        pins.0, pins.1, dev_pins[d], host_pins[d]
                    ),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{NvmeSource, StoreConfig};
    use crate::dtype::DType;
    use crate::layout::{Layout, LayoutConfig, TensorSpec};
    use tidestore_tiers::Device;
    use tidestore_tiers::DeviceConfig;

    fn store(dir: &tempfile::TempDir) -> ChunkStore {
        let layout = Layout::new(
            LayoutConfig::new(2048),
            (0..4).map(|i| TensorSpec::new(format!("t{i}"), &[2048], DType::F16, true)),
        )
        .unwrap();
        let slot = 8192;
        let cfg = StoreConfig::new(
            2 * slot,
            3 * slot,
            NvmeSource::Dir {
                dir: dir.path().to_path_buf(),
                bytes: 32 * slot,
                io: tidestore_io::IoConfig::default(),
            },
        );
        let device = Device::sim(&DeviceConfig::new(4 * slot)).unwrap();
        ChunkStore::open(layout, cfg, device).unwrap()
    }

    fn broken(store: &ChunkStore, chunk: ChunkId, what: &str) {
        match store.verify() {
            Err(ChunkError::Invariant { chunk: c, what: w }) => {
                assert_eq!(c, Some(chunk), "{w}");
                assert!(w.contains(what), "{w}");
            }
            other => panic!("expected a broken invariant ({what}), got {other:?}"),
        }
    }

    /// The failure: `verify` passing over the bugs it exists to find (a pin count that
    /// drifted from the tensors in COMPUTE, a copy the policies cannot see).
    #[test]
    fn verify_names_the_chunk_and_what_disagrees() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = store(&dir);
        let g = s
            .access(TensorId(1), ListKind::Params, Place::Device)
            .unwrap();
        s.verify().unwrap();
        let c = g.chunk();
        s.mover.test_set_pins(c, Place::Device, 2);
        broken(&s, c, "pins (device 2, host 0)");
        s.mover.test_set_pins(c, Place::Device, 1);
        s.verify().unwrap();
        s.release(g, TensorState::Hold).unwrap();

        let g = s
            .access(TensorId(2), ListKind::Master, Place::Host)
            .unwrap();
        let c = g.chunk();
        s.mover.test_host_list().retain(|&x| x != c);
        broken(&s, c, "host list");
        s.mover.test_host_list().push(c);
        // A release whose chunk lost its pin is refused and changes nothing.
        s.mover.test_set_pins(c, Place::Host, 0);
        let err = s.release_tensor(TensorId(2), ListKind::Master, TensorState::Hold);
        assert!(matches!(err, Err(ChunkError::Invariant { .. })), "{err:?}");
        assert_eq!(
            s.state(TensorId(2), ListKind::Master),
            Some(TensorState::Compute)
        );
        s.mover.test_set_pins(c, Place::Host, 1);
        s.release(g, TensorState::Hold).unwrap();
        s.verify().unwrap();
    }
}
