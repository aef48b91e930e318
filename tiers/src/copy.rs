//! What names a copy between the host and the device: its id and its direction. A leaf
//! both the backends and the errors name.

#![deny(unsafe_code)]

/// Id of a copy, unique per device, handed out by [`Device::submit_copy`](crate::Device::submit_copy) and carried by
/// its completion.
pub type CopyId = u64;

/// Direction of a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CopyDir {
    HostToDevice,
    DeviceToHost,
}

impl std::fmt::Display for CopyDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CopyDir::HostToDevice => "host->device",
            CopyDir::DeviceToHost => "device->host",
        })
    }
}
