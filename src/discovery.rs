//! What this machine offers: DMA-BUF heaps, DRM nodes and udmabuf, each with whether this
//! process may open it and, if not, why.

use std::fmt;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Where DRM nodes appear.
pub const DRI_DIR: &str = "/dev/dri";

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

/// One device node.
#[derive(Debug, Clone)]
pub struct NodeInfo {
    /// Its path.
    pub path: PathBuf,
    /// Whether we may open it.
    pub access: NodeAccess,
}

/// Primary (`card`, modesetting and dumb buffers) or render (`renderD`, unprivileged GPU work).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrmNodeKind {
    /// `/dev/dri/cardN`.
    Card,
    /// `/dev/dri/renderDN`.
    Render,
}

/// One DRM node.
#[derive(Debug, Clone)]
pub struct DrmNode {
    /// Path and access.
    pub node: NodeInfo,
    /// Card or render.
    pub kind: DrmNodeKind,
    /// Kernel driver name from sysfs (`vgem`, `i915`, ...), if known.
    pub driver: Option<String>,
}

/// Everything found.
#[derive(Debug, Clone)]
pub struct Inventory {
    /// `/dev/dma_heap/*`, sorted by name.
    pub heaps: Vec<NodeInfo>,
    /// `/dev/dri/card*` and `/dev/dri/renderD*`, sorted.
    pub drm: Vec<DrmNode>,
    /// `/dev/udmabuf`.
    pub udmabuf: NodeInfo,
    /// udmabuf's `size_limit_mb` parameter, when readable.
    pub udmabuf_limit_mb: Option<u64>,
}

/// Looks at `/dev` and `/sys`.
pub fn discover() -> Inventory {
    discover_at(Path::new("/dev"), Path::new("/sys"))
}

/// Looks at a device tree and a sysfs mounted elsewhere (containers, tests).
pub fn discover_at(dev: &Path, sys: &Path) -> Inventory {
    let heap_dir = dev.join("dma_heap");
    // Heaps are opened read-only (allocation needs no write access); the rest read-write.
    let heaps = list_dir(&heap_dir).into_iter().map(|n| node_info_mode(heap_dir.join(n), false)).collect();
    let dri = dev.join("dri");
    let mut drm = Vec::new();
    for name in list_dir(&dri) {
        let kind = if name.starts_with("renderD") {
            DrmNodeKind::Render
        } else if name.starts_with("card") {
            DrmNodeKind::Card
        } else {
            continue;
        };
        let node = node_info(dri.join(&name));
        // The bound driver from sysfs; devices with no bound driver (vgem's bare platform
        // device) are asked directly, when we may open them.
        let driver = fs::read_link(sys.join("class/drm").join(&name).join("device/driver"))
            .ok()
            .and_then(|p| p.file_name().map(|f| f.to_string_lossy().into_owned()))
            .or_else(|| node.access.allowed().then(|| driver_by_ioctl(&node.path)).flatten());
        drm.push(DrmNode { node, kind, driver });
    }
    let udmabuf_limit_mb = crate::source::shmem::read_param(sys.join("module/udmabuf/parameters/size_limit_mb"));
    Inventory { heaps, drm, udmabuf: node_info(dev.join("udmabuf")), udmabuf_limit_mb }
}

fn driver_by_ioctl(path: &Path) -> Option<String> {
    let f = fs::File::open(path).ok()?;
    crate::sys::drm::driver_name(std::os::fd::AsFd::as_fd(&f)).ok()
}

fn node_info(path: PathBuf) -> NodeInfo {
    node_info_mode(path, true)
}

fn node_info_mode(path: PathBuf, write: bool) -> NodeInfo {
    let access = check_access_mode(&path, write);
    NodeInfo { path, access }
}

/// Whether this process (its effective credentials) may open `path` read-write.
pub fn check_access(path: &Path) -> NodeAccess {
    check_access_mode(path, true)
}

fn check_access_mode(path: &Path, write: bool) -> NodeAccess {
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

/// Sorted entry names of a directory (empty when it is missing or unreadable).
pub(crate) fn list_dir(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    names.sort();
    names
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

impl fmt::Display for Inventory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn access(a: &NodeAccess) -> String {
            match a {
                NodeAccess::Allowed => "yes".into(),
                NodeAccess::Denied(why) => format!("no: {why}"),
                NodeAccess::Missing => "no: missing".into(),
            }
        }
        writeln!(f, "{:<8} {:<26} {:<18} may open", "class", "node", "detail")?;
        if self.heaps.is_empty() {
            writeln!(f, "{:<8} {:<26} {:<18} no: no DMA-BUF heaps on this kernel", "heap", "/dev/dma_heap/*", "-")?;
        }
        for h in &self.heaps {
            let name = h.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            writeln!(f, "{:<8} {:<26} {:<18} {}", "heap", h.path.display(), name, access(&h.access))?;
        }
        let limit = self.udmabuf_limit_mb.map_or("-".into(), |l| format!("limit {l} MiB"));
        let udma = match self.udmabuf.access {
            NodeAccess::Missing => "no: missing (CONFIG_UDMABUF)".into(),
            ref a => access(a),
        };
        writeln!(f, "{:<8} {:<26} {:<18} {udma}", "udmabuf", self.udmabuf.path.display(), limit)?;
        if self.drm.is_empty() {
            writeln!(f, "{:<8} {:<26} {:<18} no: no DRM nodes", "drm", "/dev/dri/*", "-")?;
        }
        for d in &self.drm {
            let kind = match d.kind {
                DrmNodeKind::Card => "card",
                DrmNodeKind::Render => "render",
            };
            let detail = format!("{kind} {}", d.driver.as_deref().unwrap_or("?"));
            writeln!(f, "{:<8} {:<26} {:<18} {}", "drm", d.node.path.display(), detail, access(&d.node.access))?;
        }
        Ok(())
    }
}
