//! What this machine offers: DMA-BUF heaps, DRM nodes and udmabuf, each with whether this
//! process may open it and, if not, why.

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

pub use crate::node::{NodeAccess, check_access};
use crate::node::{check_access_mode, list_dir, read_param};

/// Where DRM nodes appear.
pub const DRI_DIR: &str = "/dev/dri";

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
    let udmabuf_limit_mb = read_param(sys.join("module/udmabuf/parameters/size_limit_mb"));
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
