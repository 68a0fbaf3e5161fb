//! Device nodes: opening them, whether this process may, why not, and the sysfs parameters of
//! the drivers behind them. Used by [`discovery`](crate::discovery) and by the sources (shmem's
//! udmabuf, heap, gem), so that every refusal explains itself the same way.

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

use crate::error::Error;

/// Whether this process may open a node read-write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeAccess {
    /// It may.
    Allowed,
    /// The node exists but this process may not open it; the reason names owner, mode and
    /// this process's credentials.
    Denied(String),
    /// The node does not exist.
    Missing,
}

impl NodeAccess {
    /// True for [`NodeAccess::Allowed`].
    pub fn allowed(&self) -> bool {
        *self == NodeAccess::Allowed
    }
}

/// Whether this process (its effective credentials) may open `path` read-write.
pub fn check_access(path: &Path) -> NodeAccess {
    check_access_mode(path, true)
}

/// Whether this process may open `path` for reading, and for writing too when `write`.
pub(crate) fn check_access_mode(path: &Path, write: bool) -> NodeAccess {
    use rustix::fs::{Access, AtFlags, CWD, accessat};
    if fs::symlink_metadata(path).is_err() {
        return NodeAccess::Missing;
    }
    let mode = if write { Access::READ_OK | Access::WRITE_OK } else { Access::READ_OK };
    match accessat(CWD, path, mode, AtFlags::EACCESS) {
        Ok(()) => NodeAccess::Allowed,
        Err(_) => NodeAccess::Denied(why_denied(path)),
    }
}

/// Opens a device node read-write, close-on-exec, with errors that say what is missing or
/// why this process may not open it. `provider` names what would make the node appear.
pub(crate) fn open_node(path: &Path, provider: &'static str) -> Result<File, Error> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(rustix::fs::OFlags::CLOEXEC.bits() as i32)
        .open(path)
        .map_err(|e| node_error(path, provider, e))
}

/// The error for a node that could not be opened: missing (with what provides it), denied
/// (with [`why_denied`]), or refused by its driver.
pub(crate) fn node_error(path: &Path, provider: &'static str, e: std::io::Error) -> Error {
    match e.kind() {
        std::io::ErrorKind::NotFound => Error::NoDevice { path: path.to_path_buf(), hint: provider },
        std::io::ErrorKind::PermissionDenied => {
            Error::Open { path: path.to_path_buf(), why: why_denied(path), source: e }
        }
        _ => Error::Open { path: path.to_path_buf(), why: "the driver refused the open".into(), source: e },
    }
}

/// Explains why this process may not open `path`: owner, group, mode, and our credentials.
pub(crate) fn why_denied(path: &Path) -> String {
    let euid = rustix::process::geteuid().as_raw();
    let egid = rustix::process::getegid().as_raw();
    let groups: Vec<u32> = rustix::process::getgroups().unwrap_or_default().iter().map(|g| g.as_raw()).collect();
    let Ok(md) = fs::metadata(path) else {
        return format!("{} cannot be examined by uid {euid}", path.display());
    };
    let (uid, gid, mode) = (md.uid(), md.gid(), md.mode() & 0o7777);
    let in_group = gid == egid || groups.contains(&gid);
    let who = if uid == euid {
        "this process owns it"
    } else if in_group {
        "this process is in its group"
    } else {
        "this process is neither its owner nor in its group"
    };
    format!(
        "{} is {}:{} mode {:04o} and {who} (uid {euid}, gid {egid}, groups {:?}); \
         install udev/60-dmabuf-rt.rules and add the user to group `render`",
        path.display(),
        user_name(uid),
        group_name(gid),
        mode,
        groups
    )
}

/// The name `/etc/passwd` or `/etc/group` gives an id.
fn lookup(file: &str, id: u32) -> Option<String> {
    let text = fs::read_to_string(file).ok()?;
    text.lines().find_map(|l| {
        let mut f = l.split(':');
        let name = f.next()?;
        f.next()?;
        (f.next()?.parse::<u32>().ok()? == id).then(|| name.to_string())
    })
}

fn user_name(uid: u32) -> String {
    lookup("/etc/passwd", uid).unwrap_or_else(|| uid.to_string())
}

fn group_name(gid: u32) -> String {
    lookup("/etc/group", gid).unwrap_or_else(|| gid.to_string())
}

/// Sorted entry names of a device directory (`/dev/dma_heap`, `/dev/dri`); empty when it is
/// missing or unreadable.
pub(crate) fn list_dir(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    names.sort();
    names
}

/// A driver's numeric module parameter from sysfs (`/sys/module/<driver>/parameters/<name>`).
pub(crate) fn read_param(path: impl AsRef<Path>) -> Option<u64> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}
