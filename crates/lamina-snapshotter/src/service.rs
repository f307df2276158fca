//! The gRPC face of the snapshotter: containerd's snapshots service over a
//! unix socket. Each call runs on the blocking pool. The snapshotter is
//! behind one mutex, held only for its state and local work: a Prepare's
//! image is resolved from its registry before the lock is taken, and a call
//! that needs a lamina image still being mounted in the background waits
//! for that mount without it. So a slow registry holds up only the calls
//! that need its images (issue 42).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::metrics::Metrics;
use crate::proto::{self, snapshots_server::Snapshots};
use crate::snapshots::{remote_layer, Error, Images, Info, Resolve, Resolved, Snapshotter};
use crate::state::Kind;

/// The service, sharing one snapshotter.
pub struct Service<I> {
    inner: Arc<Mutex<Snapshotter<I>>>,
    metrics: Arc<Metrics>,
    /// Resolves images without the snapshotter's lock.
    resolver: Option<Arc<dyn Resolve>>,
}

impl<I: Images> Service<I> {
    /// Serves `snapshotter`, counting calls in `metrics`.
    pub fn new(inner: Arc<Mutex<Snapshotter<I>>>, metrics: Arc<Metrics>) -> Self {
        let resolver = inner.lock().unwrap_or_else(|p| p.into_inner()).resolver();
        Service {
            inner,
            metrics,
            resolver,
        }
    }
}

impl<I> Service<I> {
    /// Counts a call refused before it reached the snapshotter.
    fn refuse(&self, op: &'static str, status: Status) -> Status {
        self.metrics.record_call(op, Some(status.code()));
        status
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Status {
        Status::new(grpc_code(&e), e.to_string())
    }
}

/// The gRPC code containerd expects for each error.
fn grpc_code(e: &Error) -> tonic::Code {
    match e {
        Error::NotFound(_) => tonic::Code::NotFound,
        Error::AlreadyExists(_) => tonic::Code::AlreadyExists,
        Error::FailedPrecondition(_) => tonic::Code::FailedPrecondition,
        Error::InvalidArgument(_) => tonic::Code::InvalidArgument,
        Error::Internal(_) => tonic::Code::Internal,
    }
}

fn labels(map: HashMap<String, String>) -> BTreeMap<String, String> {
    map.into_iter().collect()
}

fn timestamp(t: SystemTime) -> prost_types::Timestamp {
    t.into()
}

fn to_proto(i: Info) -> proto::Info {
    let kind = match i.kind {
        Kind::View => proto::Kind::View,
        Kind::Active => proto::Kind::Active,
        Kind::Committed => proto::Kind::Committed,
    };
    proto::Info {
        name: i.name,
        parent: i.parent,
        kind: kind as i32,
        created_at: Some(timestamp(i.created)),
        updated_at: Some(timestamp(i.updated)),
        labels: i.labels.into_iter().collect(),
    }
}

impl<I: Images + 'static> Service<I> {
    /// The role of the layer a Prepare's `labels` name for a remote
    /// snapshot, resolved from its registry without the lock (`None`: no
    /// such labels, or no resolver: the snapshotter asks under its lock).
    async fn resolve(&self, labels: &BTreeMap<String, String>) -> Resolved {
        let ((image, layer), resolver) = (remote_layer(labels)?, self.resolver.clone()?);
        let lookup = tokio::task::spawn_blocking(move || resolver.lookup(&image, &layer));
        Some(
            lookup
                .await
                .unwrap_or_else(|e| Err(format!("resolving: {e}"))),
        )
    }

    /// Waits, without the lock, for the background mount of the lamina
    /// image that a call on `key` (or a new snapshot on `parent`) needs.
    async fn settle(&self, key: &str, parent: &str) {
        let inner = self.inner.clone();
        let (key, parent) = (key.to_string(), parent.to_string());
        let _ = tokio::task::spawn_blocking(move || {
            let wait = inner
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .mount_wait(&key, &parent);
            if let Some(wait) = wait {
                wait();
            }
        })
        .await;
    }

    /// Runs `f` on the snapshotter, off the async threads, and counts it.
    async fn with<T, F>(&self, op: &'static str, f: F) -> Result<T, Status>
    where
        T: Send + 'static,
        F: FnOnce(&mut Snapshotter<I>) -> Result<T, Error> + Send + 'static,
    {
        let inner = self.inner.clone();
        let metrics = self.metrics.clone();
        let started = std::time::Instant::now();
        let res = tokio::task::spawn_blocking(move || {
            let mut sn = inner.lock().unwrap_or_else(|p| p.into_inner());
            let res = f(&mut sn);
            // Under the lock anyway: scrapes then never need it.
            metrics.set_snapshots(sn.census());
            res
        })
        .await
        .map_err(|e| self.refuse(op, Status::internal(format!("{op}: {e}"))))?;
        self.metrics
            .record_call(op, res.as_ref().err().map(grpc_code));
        tracing::debug!(op, us = started.elapsed().as_micros() as u64, "call done");
        match &res {
            Err(Error::Internal(msg)) => tracing::error!(op, "{msg}"),
            Err(e @ (Error::FailedPrecondition(_) | Error::InvalidArgument(_))) => {
                tracing::info!(op, "{e}")
            }
            _ => {}
        }
        res.map_err(Status::from)
    }
}

#[tonic::async_trait]
impl<I: Images + 'static> Snapshots for Service<I> {
    async fn prepare(
        &self,
        req: Request<proto::PrepareSnapshotRequest>,
    ) -> Result<Response<proto::PrepareSnapshotResponse>, Status> {
        let r = req.into_inner();
        let labels = labels(r.labels);
        let role = self.resolve(&labels).await;
        self.settle(&r.key, &r.parent).await;
        let mounts = self
            .with("prepare", move |s| {
                s.prepare_resolved(&r.key, &r.parent, labels, role)
            })
            .await?;
        Ok(Response::new(proto::PrepareSnapshotResponse { mounts }))
    }

    async fn view(
        &self,
        req: Request<proto::ViewSnapshotRequest>,
    ) -> Result<Response<proto::ViewSnapshotResponse>, Status> {
        let r = req.into_inner();
        self.settle(&r.key, &r.parent).await;
        let mounts = self
            .with("view", move |s| s.view(&r.key, &r.parent, labels(r.labels)))
            .await?;
        Ok(Response::new(proto::ViewSnapshotResponse { mounts }))
    }

    async fn mounts(
        &self,
        req: Request<proto::MountsRequest>,
    ) -> Result<Response<proto::MountsResponse>, Status> {
        let r = req.into_inner();
        self.settle(&r.key, "").await;
        let mounts = self.with("mounts", move |s| s.mounts(&r.key)).await?;
        Ok(Response::new(proto::MountsResponse { mounts }))
    }

    async fn commit(
        &self,
        req: Request<proto::CommitSnapshotRequest>,
    ) -> Result<Response<proto::Empty>, Status> {
        let r = req.into_inner();
        if !r.parent.is_empty() {
            return Err(self.refuse(
                "commit",
                Status::unimplemented("commit onto another parent (rebase) is not supported"),
            ));
        }
        self.with("commit", move |s| {
            s.commit(&r.name, &r.key, labels(r.labels))
        })
        .await?;
        Ok(Response::new(proto::Empty {}))
    }

    async fn remove(
        &self,
        req: Request<proto::RemoveSnapshotRequest>,
    ) -> Result<Response<proto::Empty>, Status> {
        let r = req.into_inner();
        self.with("remove", move |s| s.remove(&r.key)).await?;
        Ok(Response::new(proto::Empty {}))
    }

    async fn stat(
        &self,
        req: Request<proto::StatSnapshotRequest>,
    ) -> Result<Response<proto::StatSnapshotResponse>, Status> {
        let r = req.into_inner();
        let info = self.with("stat", move |s| s.stat(&r.key)).await?;
        Ok(Response::new(proto::StatSnapshotResponse {
            info: Some(to_proto(info)),
        }))
    }

    async fn update(
        &self,
        req: Request<proto::UpdateSnapshotRequest>,
    ) -> Result<Response<proto::UpdateSnapshotResponse>, Status> {
        let r = req.into_inner();
        let info = r.info.ok_or_else(|| {
            self.refuse("update", Status::invalid_argument("update without info"))
        })?;
        let paths = r.update_mask.map(|m| m.paths).unwrap_or_default();
        let info = self
            .with("update", move |s| {
                s.update(&info.name, labels(info.labels), &paths)
            })
            .await?;
        Ok(Response::new(proto::UpdateSnapshotResponse {
            info: Some(to_proto(info)),
        }))
    }

    type ListStream = ReceiverStream<Result<proto::ListSnapshotsResponse, Status>>;

    async fn list(
        &self,
        req: Request<proto::ListSnapshotsRequest>,
    ) -> Result<Response<Self::ListStream>, Status> {
        let r = req.into_inner();
        let infos = self.with("list", move |s| s.walk(&r.filters)).await?;
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            let mut infos = infos.into_iter().map(to_proto).peekable();
            // Batches keep each message well under gRPC's 4 MiB default.
            while infos.peek().is_some() {
                let info: Vec<_> = infos.by_ref().take(100).collect();
                if tx
                    .send(Ok(proto::ListSnapshotsResponse { info }))
                    .await
                    .is_err()
                {
                    break;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn usage(
        &self,
        req: Request<proto::UsageRequest>,
    ) -> Result<Response<proto::UsageResponse>, Status> {
        let r = req.into_inner();
        let (size, inodes) = self.with("usage", move |s| s.usage(&r.key)).await?;
        Ok(Response::new(proto::UsageResponse { size, inodes }))
    }

    async fn cleanup(
        &self,
        _req: Request<proto::CleanupRequest>,
    ) -> Result<Response<proto::Empty>, Status> {
        let removed = self.with("cleanup", |s| s.cleanup()).await?;
        for path in removed {
            tracing::info!(path = %path.display(), "cleanup removed an orphaned snapshot directory");
        }
        Ok(Response::new(proto::Empty {}))
    }
}
