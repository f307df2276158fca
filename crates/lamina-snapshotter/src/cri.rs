//! The CRI image service on the snapshotter's socket, in front of
//! containerd's, so that a pod's image pull secrets reach the lamina mounts
//! of that pod's images (stargz-snapshotter's CRI keychain). The kubelet's
//! `--image-service-endpoint` names the snapshotter's socket; every call goes
//! on to containerd's CRI as the bytes that came (a field this file does not
//! know passes unchanged), and a PullImage's credentials are kept for the
//! image it names before containerd starts pulling it (its layers' Prepare
//! calls come during that pull).
//!
//! Each call goes on with the caller's metadata, its deadline
//! (`grpc-timeout`) among it: the proxy adds no deadline of its own, so a
//! pull may take as long as it would talking to containerd directly.
//!
//! The messages below are the few fields of `runtime.v1` (k8s.io/cri-api's
//! `api.proto`) the snapshotter reads; `build.rs` describes the service.

use std::path::Path;
use std::sync::Arc;

use bytes::{Buf, BufMut, Bytes};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::{Request, Response, Status, Streaming};

use crate::pull_secrets::{PodAuth, PullSecrets};

/// A CRI message as it came, forwarded without being parsed.
#[derive(Debug, Clone)]
pub struct Raw(pub Bytes);

/// The codec of [`Raw`]: the message bytes, untouched. (Not a unit
/// struct: the generated code builds it with `default()`.)
#[derive(Debug, Clone, Copy, Default)]
pub struct RawCodec(());

impl Codec for RawCodec {
    type Encode = Raw;
    type Decode = Raw;
    type Encoder = RawCodec;
    type Decoder = RawCodec;

    fn encoder(&mut self) -> RawCodec {
        *self
    }

    fn decoder(&mut self) -> RawCodec {
        *self
    }
}

impl Encoder for RawCodec {
    type Item = Raw;
    type Error = Status;

    fn encode(&mut self, item: Raw, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put(item.0);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = Raw;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Raw>, Status> {
        Ok(Some(Raw(src.copy_to_bytes(src.remaining()))))
    }
}

/// `runtime.v1.PullImageRequest`, the fields read here.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PullImageRequest {
    #[prost(message, optional, tag = "1")]
    pub image: Option<ImageSpec>,
    #[prost(message, optional, tag = "2")]
    pub auth: Option<AuthConfig>,
}

/// `runtime.v1.ImageSpec`, the field read here.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ImageSpec {
    #[prost(string, tag = "1")]
    pub image: String,
}

/// `runtime.v1.AuthConfig`. Its Debug shows no secret.
#[derive(Clone, PartialEq, prost::Message)]
#[prost(skip_debug)]
pub struct AuthConfig {
    #[prost(string, tag = "1")]
    pub username: String,
    #[prost(string, tag = "2")]
    pub password: String,
    #[prost(string, tag = "3")]
    pub auth: String,
    #[prost(string, tag = "4")]
    pub server_address: String,
    #[prost(string, tag = "5")]
    pub identity_token: String,
    #[prost(string, tag = "6")]
    pub registry_token: String,
}

impl std::fmt::Debug for AuthConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthConfig")
            .field("username", &self.username)
            .field("server_address", &self.server_address)
            .finish_non_exhaustive()
    }
}

impl AuthConfig {
    /// What the pod brought, in the forms lamina's registry client
    /// speaks; `Err` names a form it does not (a bare registry token).
    fn pod_auth(&self) -> Result<Option<PodAuth>, &'static str> {
        if !self.identity_token.is_empty() {
            return Ok(Some(PodAuth::IdentityToken(self.identity_token.clone())));
        }
        if !self.auth.is_empty() {
            return Ok(Some(PodAuth::Encoded(self.auth.clone())));
        }
        if !self.username.is_empty() {
            return Ok(Some(PodAuth::Basic {
                username: self.username.clone(),
                password: self.password.clone(),
            }));
        }
        if !self.registry_token.is_empty() {
            return Err("a bare registry token (registry_token)");
        }
        Ok(None)
    }
}

/// The image service: containerd's, with the pull secrets kept on the way.
#[derive(Debug)]
pub struct ImageProxy {
    containerd: crate::proto::image_service_client::ImageServiceClient<tonic::transport::Channel>,
    secrets: Arc<PullSecrets>,
}

impl ImageProxy {
    /// Forwards to containerd's socket `containerd` (connected on first
    /// use, again after it restarts), keeping pull secrets in `secrets`.
    pub fn new(containerd: &Path, secrets: Arc<PullSecrets>) -> anyhow::Result<ImageProxy> {
        let path = containerd.to_path_buf();
        // The URI is a placeholder: every connection is to the socket.
        let channel = tonic::transport::Endpoint::try_from("http://[::1]:0")?
            .connect_with_connector_lazy(tower::service_fn(move |_| {
                let path = path.clone();
                async move {
                    let stream = tokio::net::UnixStream::connect(path).await?;
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
                }
            }));
        Ok(ImageProxy {
            containerd: crate::proto::image_service_client::ImageServiceClient::new(channel),
            secrets,
        })
    }

    /// Keeps what `request` (a PullImageRequest) brings for its image:
    /// its credentials, or that it brought none.
    fn keep_secret(&self, request: &Raw) -> Result<(), Status> {
        let pull = <PullImageRequest as prost::Message>::decode(request.0.clone())
            .map_err(|e| Status::invalid_argument(format!("PullImageRequest: {e}")))?;
        let image = pull.image.map(|i| i.image).unwrap_or_default();
        let auth = match pull.auth.as_ref().map(AuthConfig::pod_auth) {
            Some(Err(form)) => {
                // containerd still pulls with it; the mounts cannot.
                tracing::warn!(
                    "{image}: the pod's pull secret is {form}, which lamina's registry client \
                     does not speak: its lazy mounts fetch with the node's credentials"
                );
                None
            }
            Some(Ok(auth)) => auth,
            None => None,
        };
        self.secrets
            .record(&image, auth.as_ref())
            .map_err(|e| Status::internal(format!("keeping {image}'s pull secret: {e}")))
    }
}

/// The request as it goes on to containerd: its metadata (the caller's
/// deadline among it) and message.
fn onward(request: Request<Raw>) -> Request<Raw> {
    let (metadata, _, message) = request.into_parts();
    Request::from_parts(metadata, tonic::Extensions::default(), message)
}

#[tonic::async_trait]
impl crate::proto::image_service_server::ImageService for ImageProxy {
    async fn list_images(&self, request: Request<Raw>) -> Result<Response<Raw>, Status> {
        self.containerd.clone().list_images(onward(request)).await
    }

    type StreamImagesStream = Streaming<Raw>;

    async fn stream_images(
        &self,
        request: Request<Raw>,
    ) -> Result<Response<Streaming<Raw>>, Status> {
        self.containerd.clone().stream_images(onward(request)).await
    }

    async fn image_status(&self, request: Request<Raw>) -> Result<Response<Raw>, Status> {
        self.containerd.clone().image_status(onward(request)).await
    }

    async fn pull_image(&self, request: Request<Raw>) -> Result<Response<Raw>, Status> {
        self.keep_secret(request.get_ref())?;
        self.containerd.clone().pull_image(onward(request)).await
    }

    async fn remove_image(&self, request: Request<Raw>) -> Result<Response<Raw>, Status> {
        self.containerd.clone().remove_image(onward(request)).await
    }

    async fn image_fs_info(&self, request: Request<Raw>) -> Result<Response<Raw>, Status> {
        self.containerd.clone().image_fs_info(onward(request)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    fn pull(image: &str, auth: Option<AuthConfig>) -> PullImageRequest {
        PullImageRequest {
            image: Some(ImageSpec {
                image: image.into(),
            }),
            auth,
        }
    }

    #[test]
    fn a_pull_request_decodes_past_fields_it_does_not_know() {
        let mut bytes = pull(
            "h:5000/app:v1",
            Some(AuthConfig {
                username: "alice".into(),
                password: "pw".into(),
                ..AuthConfig::default()
            }),
        )
        .encode_to_vec();
        // sandbox_config (3), as the kubelet sends it: skipped.
        bytes.extend_from_slice(&[0x1a, 0x02, 0x0a, 0x00]);
        let back = PullImageRequest::decode(Bytes::from(bytes)).unwrap();
        assert_eq!(back.image.unwrap().image, "h:5000/app:v1");
        let auth = back.auth.unwrap().pod_auth().unwrap().unwrap();
        assert!(matches!(auth, PodAuth::Basic { ref username, .. } if username == "alice"));
    }

    #[test]
    fn auth_forms_are_read_in_the_kubelets_order() {
        let token = AuthConfig {
            identity_token: "t".into(),
            username: "u".into(),
            ..AuthConfig::default()
        };
        assert!(matches!(
            token.pod_auth(),
            Ok(Some(PodAuth::IdentityToken(_)))
        ));
        let bare = AuthConfig {
            registry_token: "r".into(),
            ..AuthConfig::default()
        };
        assert!(bare.pod_auth().is_err());
        assert!(AuthConfig::default().pod_auth().unwrap().is_none());
    }
}
